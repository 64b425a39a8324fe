// One trajectory: the prompt, every response token (policy vs inserted; SIS status when recorded; sampled after
// a weight load that landed mid-trajectory), a detail panel for the token under the pointer (click pins it), the
// searches, and the reward with its parts.
import { enc, get } from "./api.js";
import { el, facts, fmt, shown } from "./dom.js";

const STATUS = { 1: ["acc", "accepted"], 0: ["rej", "rejected (in V_K)"], 2: ["out", "outside V_K (rejected)"],
  [-1]: ["undecided", "no decision (-1)"] };

// The policy version that sampled token t (-1: inserted); stores from before per-token versions have none.
function versionOf(traj, t) {
  return traj.token_versions ? traj.token_versions[t] : (traj.loss_mask[t] ? traj.policy_version : -1);
}

function tokenClass(t, traj) {
  if (!traj.loss_mask[t]) return "tok inserted";
  const status = traj.sis ? traj.sis.status[t] : null;
  const newer = versionOf(traj, t) > traj.policy_version ? " newer" : "";
  return (status === null ? "tok policy" : `tok policy ${STATUS[status][0]}`) + newer;
}

// "3" for one version; "3 → 4 (from token 57)" where a load landed mid-trajectory (partial rollouts).
function versionSpan(traj) {
  const versions = traj.response_ids.map((_, t) => versionOf(traj, t)).filter((v) => v >= 0);
  if (!versions.length) return String(traj.policy_version);
  const low = Math.min(...versions);
  const high = Math.max(...versions);
  if (low === high) return String(low);
  const first = traj.response_ids.findIndex((_, t) => versionOf(traj, t) > low);
  return `${low} → ${high} (a weight load landed mid-trajectory; newer from token ${first})`;
}

function pieceOf(texts, id) {
  const text = texts.pieces[String(id)];
  return text === undefined ? `⟨${id}⟩` : text;
}

function detail(panel, traj, texts, t) {
  const id = traj.response_ids[t];
  const policy = Boolean(traj.loss_mask[t]);
  const rows = [["position", t], ["token id", id], ["text", el("span", { class: "piece" }, shown(pieceOf(texts, id)))],
    ["kind", policy ? "policy (sampled)" : "inserted by the environment"]];
  if (policy) {
    const logq = traj.behaviour_logprobs[t];
    const topk = traj.topk_ids[t] || [];
    const rank = topk.indexOf(id);
    rows.push(["policy version", versionOf(traj, t)], ["log q", fmt(logq, 4)], ["rank in q's top-K", rank >= 0 ? `${rank + 1} of ${topk.length}` : `not in top-${topk.length}`]);
    if (traj.sis) {
      const s = traj.sis;
      rows.push(["SIS status", STATUS[s.status[t]][1]], ["log π", fmt(s.logp[t], 4)],
        ["l = log π − log q", fmt(s.logp[t] - logq, 4)], ["ratio used", fmt(s.ratio[t], 4)], ["log M", fmt(s.log_m[t], 4)]);
    }
    const alternatives = topk.slice(0, 8).map((alt, j) => el("tr", {},
      el("td", { class: "num" }, j + 1), el("td", {}, el("span", { class: "piece" }, shown(pieceOf(texts, alt)))),
      el("td", { class: "num" }, fmt(traj.topk_logprobs[t][j], 3))));
    panel.replaceChildren(el("h3", {}, "Token"), facts(rows), el("h3", {}, "q's top-K (first 8)"),
      el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "#"), el("th", {}, "token"), el("th", {}, "log q"))),
        el("tbody", {}, alternatives)));
  } else {
    panel.replaceChildren(el("h3", {}, "Token"), facts(rows));
  }
}

function tokens(traj, texts, panel) {
  const box = el("div", { id: "tokens", class: "tokens" });
  box.append(...traj.response_ids.map((id, t) =>
    el("span", { class: tokenClass(t, traj), dataset: { t } }, pieceOf(texts, id))));
  let pinned = null;
  const at = (event) => (event.target instanceof HTMLElement && event.target.dataset.t !== undefined
    ? Number(event.target.dataset.t) : null);
  box.addEventListener("mouseover", (event) => {
    const t = at(event);
    if (t !== null && pinned === null) detail(panel, traj, texts, t);
  });
  box.addEventListener("click", (event) => {
    const t = at(event);
    if (t === null) return;
    box.querySelector(".pinned")?.classList.remove("pinned");
    pinned = pinned === t ? null : t;
    if (pinned !== null) event.target.classList.add("pinned");
    detail(panel, traj, texts, t);
  });
  return box;
}

function legend(traj) {
  const item = (cls, text) => el("span", { class: cls }, text);
  const items = [item("tok inserted", "inserted (retrieved passages, tags)")];
  if (traj.sis) {
    for (const [cls, text] of Object.values(STATUS)) items.push(item(`tok policy ${cls}`, text));
  } else {
    items.push(item("tok policy", "policy token (no SIS record)"));
  }
  if (traj.response_ids.some((_, t) => versionOf(traj, t) > traj.policy_version)) {
    items.push(item("tok policy newer", "sampled by a newer policy version (overlined)"));
  }
  return el("div", { class: "legend" }, items);
}

function searches(traj) {
  if (!traj.turns.length) return el("p", { class: "muted", id: "searches" }, "no searches");
  return el("table", { id: "searches" },
    el("thead", {}, el("tr", {}, ["#", "query", "retrieved doc ids (score)"].map((h) => el("th", {}, h)))),
    el("tbody", {}, traj.turns.map((turn, i) => el("tr", {}, el("td", { class: "num" }, i + 1), el("td", {}, turn.query),
      el("td", {}, turn.doc_ids.map((d, j) => `${d} (${fmt(turn.scores[j], 3)})`).join(", "))))));
}

function sisFacts(sis) {
  if (!sis) return el("p", { class: "muted" }, "No SIS record for this trajectory (the trainer posts them when "
    + "its SIS recording is on).");
  const s = sis.summary;
  const decided = s.accepted + s.rejected + s.outside;
  return facts([["policy version", sis.policy_version], ["trainer step", sis.step], ["advantage", fmt(sis.advantage, 4)],
    ["accepted", s.accepted], ["rejected (in V_K)", s.rejected], ["outside V_K", s.outside],
    ["accept rate", decided ? fmt(s.accepted / decided) : "–"], ["D", fmt(s.d)], ["D_SIS", fmt(s.d_sis)]]);
}

export async function showTrajectory(main, id) {
  const [traj, texts] = await Promise.all([get(`/v1/rollouts/${enc(id)}`), get(`/v1/rollouts/${enc(id)}/texts`)]);
  const panel = el("aside", { class: "detail", id: "token-detail" },
    el("p", { class: "muted" }, "Point at a token for its ids, log-probs and ratio; click to pin it."));
  const parts = traj.reward_parts;
  main.replaceChildren(
    el("p", {}, el("a", { href: `#/run/${enc(traj.run)}` }, `← run ${traj.run}`)),
    el("h1", {}, `Trajectory ${traj.id}`),
    facts([["question", traj.question], ["gold answers", traj.golden_answers.join(" | ")], ["answer", traj.answer ?? "–"],
      ["reward", `${fmt(traj.reward)} (EM ${fmt(parts.em)}, F1 ${fmt(parts.f1)}, format ${fmt(parts.format)})`],
      ["finish reason", traj.finish_reason + (traj.error ? ` – ${traj.error}` : "")],
      ["run / step / source", `${traj.run} / ${traj.step} / ${traj.data_source}`], ["policy version", el("span", { id: "versions" }, versionSpan(traj))],
      ["tokens", `${traj.response_ids.length} response (${traj.loss_mask.filter(Boolean).length} policy), `
        + `${traj.prompt_ids.length} prompt`], ["tokenizer", texts.tokenizer ?? "none: token ids shown"]]),
    el("h2", {}, "SIS"), sisFacts(traj.sis),
    el("h2", {}, "Prompt"), el("pre", { class: "prompt", id: "prompt" }, texts.prompt ?? traj.prompt_ids.join(" ")),
    el("h2", {}, "Response"), legend(traj),
    el("div", { class: "trajectory" }, tokens(traj, texts, panel), panel),
    el("h2", {}, "Searches"), searches(traj));
}
