// The viewer's router: #/ (runs), #/run/<run>, #/trajectory/<id>. Asks for the API token first when the
// gateway needs one (GET /health says so; /health itself needs none).
import { AuthNeeded, health, setToken, token } from "./api.js";
import { showRun, showRuns } from "./runs.js";
import { showTrajectory } from "./trajectory.js";

const $ = (id) => document.getElementById(id);
let gateway = null;

function askToken(message) {
  $("token-message").textContent = message || "";
  $("token-form").hidden = false;
  $("main").replaceChildren();
  document.body.dataset.view = "token";
  document.body.dataset.ready = "1";
  $("token-input").focus();
}

function report(error) {
  if (error instanceof AuthNeeded) {
    askToken(error.message);
    return;
  }
  $("error").textContent = String(error.message || error);
  $("error").hidden = false;
  document.body.dataset.ready = "1";
}

async function route() {
  document.body.dataset.ready = "0";
  $("error").hidden = true;
  if (gateway.token_required && !token()) {
    askToken("");
    return;
  }
  $("token-form").hidden = true;
  const [view, ...rest] = window.location.hash.replace(/^#\/?/, "").split("/");
  const arg = decodeURIComponent(rest.join("/"));
  const main = $("main");
  delete main.dataset.listGeneration;
  document.body.dataset.view = view || "runs";
  try {
    if (view === "run" && arg) await showRun(main, arg, report);
    else if (view === "trajectory" && arg) await showTrajectory(main, arg);
    else {
      document.body.dataset.view = "runs";
      await showRuns(main);
    }
    document.title = `sisrl viewer – ${document.querySelector("h1")?.textContent ?? ""}`;
    document.body.dataset.ready = "1";
  } catch (error) {
    report(error);
  }
}

async function start() {
  gateway = await health();
  $("gateway-status").textContent = gateway.store_only
    ? "store-only gateway (no engine)" : `engine ${gateway.engine}, policy version ${gateway.policy_version}`;
  const button = $("token-button");
  button.hidden = !gateway.token_required;
  button.addEventListener("click", () => {
    setToken(null);
    askToken("enter a new token");
  });
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setToken($("token-input").value);
    $("token-input").value = "";
    route();
  });
  window.addEventListener("hashchange", route);
  await route();
}

start().catch(report);
