// The runs list, and one run: per-step charts, the tokens SIS accepts and rejects most, its trajectories.
import { enc, get } from "./api.js";
import { lineChart } from "./charts.js";
import { el, fmt, shown } from "./dom.js";

const MAX_ROWS = 2000; // trajectories fetched for one filter (pages of 1000); sorting happens in the page

export async function showRuns(main) {
  const runs = await get("/v1/runs", { limit: 1000 });
  main.replaceChildren(el("h1", {}, "Runs"));
  if (runs.count === 0) {
    main.append(el("p", { class: "muted" }, "The store holds no trajectories yet."));
    return;
  }
  const rows = runs.data.map((r) =>
    el("tr", { dataset: { run: r.run } },
      el("td", {}, el("a", { href: `#/run/${enc(r.run)}` }, r.run)),
      el("td", { class: "num" }, r.trajectories), el("td", { class: "num" }, r.steps),
      el("td", { class: "num" }, `${r.first_step}–${r.last_step}`), el("td", { class: "num" }, r.sis_records)));
  main.append(el("table", { id: "runs" },
    el("thead", {}, el("tr", {}, ["run", "trajectories", "steps", "step range", "SIS records"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows)));
}

function chart(title, series, options) {
  const canvas = el("canvas", { role: "img", "aria-label": title });
  const box = el("figure", { class: "chart" }, el("figcaption", {}, title), canvas);
  return { box, draw: () => lineChart(canvas, series, options) };
}

function charts(stats, sis) {
  const steps = stats.data;
  const sources = [...new Set(steps.flatMap((s) => Object.keys(s.em_by_source)))].sort();
  const line = (name, rows, key) => ({ name, points: rows.map((s) => [s.step, key(s)]) });
  const noSis = { empty: "no SIS records for this run" };
  return [
    chart("mean reward", [line("reward", steps, (s) => s.reward_mean)]),
    chart("EM per data source",
      sources.map((src) => line(src, steps.filter((s) => src in s.em_by_source), (s) => s.em_by_source[src])),
      { yMin: 0, yMax: 1 }),
    chart("SIS accept rate", sis.data.length ? [line("accepted", sis.data, (s) => s.accept_rate),
      line("outside V_K", sis.data, (s) => (s.policy_tokens ? s.outside / s.policy_tokens : 0))] : [],
    { yMin: 0, yMax: 1, ...noSis }),
    chart("D vs D_SIS (mean per trajectory)", sis.data.length ? [line("D", sis.data, (s) => s.d_mean),
      line("D_SIS", sis.data, (s) => s.d_sis_mean)] : [], { yMin: 0, ...noSis }),
    chart("searches per trajectory", [line("searches", steps, (s) => s.searches_mean)], { yMin: 0 }),
  ];
}

function tokenList(id, title, entries, key) {
  const items = entries.map((t) => el("li", { dataset: { token: t.token_id } },
    el("span", { class: "piece" }, t.text === null ? `id ${t.token_id}` : shown(t.text)), " ",
    el("span", { class: "muted" }, key(t))));
  return el("section", {}, el("h3", {}, title),
    items.length ? el("ol", { id, class: "tokens-list" }, items) : el("p", { class: "muted" }, "none yet"));
}

function filters(stats, onChange) {
  const steps = stats.data.map((s) => s.step);
  const sources = [...new Set(stats.data.flatMap((s) => Object.keys(s.em_by_source)))].sort();
  const select = (id, label, options) => el("label", {}, label,
    el("select", { id, onchange: onChange }, options.map(([value, text]) => el("option", { value }, text))));
  const number = (id, label) => el("label", {}, label,
    el("input", { id, type: "number", step: "any", onchange: onChange }));
  return el("div", { class: "filters" },
    select("f-step", "step", [["", "all"], ...steps.map((s) => [String(s), String(s)])]),
    select("f-source", "data source", [["", "all"], ...sources.map((s) => [s, s])]),
    number("f-reward-min", "reward ≥"), number("f-reward-max", "reward ≤"),
    select("f-searched", "searched", [["", "any"], ["true", "searched"], ["false", "not searched"]]),
    select("f-sort", "sort", [["seq", "as stored"], ["-reward", "reward, high first"], ["reward", "reward, low first"],
      ["-length", "length, long first"], ["length", "length, short first"]]));
}

async function fetchTrajectories(params) {
  const rows = [];
  let cursor = null;
  do {
    const page = await get("/v1/rollouts", { ...params, limit: 1000, cursor });
    rows.push(...page.data);
    cursor = page.next_cursor;
  } while (cursor && rows.length < MAX_ROWS);
  return { rows: rows.slice(0, MAX_ROWS), more: Boolean(cursor) || rows.length > MAX_ROWS };
}

function sortRows(rows, order) {
  const key = { reward: (r) => r.reward, length: (r) => r.response_len }[order.replace("-", "")];
  if (!key) return rows;
  const sign = order.startsWith("-") ? -1 : 1;
  return [...rows].sort((a, b) => sign * (key(a) - key(b)));
}

function trajectoryRow(t) {
  return el("tr", { dataset: { id: t.id } },
    el("td", {}, el("a", { href: `#/trajectory/${enc(t.id)}`, title: t.id }, t.id.slice(0, 10))),
    el("td", { class: "num" }, t.step), el("td", {}, t.data_source), el("td", { class: "num" }, fmt(t.reward)),
    el("td", { class: "num" }, fmt(t.reward_parts.em)), el("td", { class: "num" }, t.num_searches),
    el("td", { class: "num" }, t.response_len), el("td", {}, t.finish_reason), el("td", {}, t.answer ?? "–"));
}

// `report` shows errors of later work (a filter change) the way the router shows its own.
export async function showRun(main, run, report) {
  const [stats, sis, tokens] = await Promise.all([
    get(`/v1/runs/${enc(run)}/stats`), get(`/v1/runs/${enc(run)}/sis_stats`),
    get(`/v1/runs/${enc(run)}/sis_tokens`, { top: 24 })]);
  const drawn = charts(stats, sis);
  const count = el("p", { id: "traj-count", class: "muted" });
  const body = el("tbody", { id: "traj-rows" });
  let generation = 0;
  const value = (id) => main.querySelector(`#${id}`).value;
  const refresh = async () => {
    const mine = ++generation;
    const step = value("f-step");
    const { rows, more } = await fetchTrajectories({
      run, step_min: step, step_max: step, data_source: value("f-source"), reward_min: value("f-reward-min"),
      reward_max: value("f-reward-max"), searched: value("f-searched") });
    if (mine !== generation) return; // a newer filter is on its way
    body.replaceChildren(...sortRows(rows, value("f-sort")).map(trajectoryRow));
    count.textContent = `${rows.length} trajectories${more ? ` (the first ${MAX_ROWS} shown; narrow the filters)` : ""}`;
    main.dataset.listGeneration = String(generation);
  };
  main.replaceChildren(
    el("p", {}, el("a", { href: "#/" }, "← runs")), el("h1", {}, `Run ${run}`),
    el("div", { class: "charts" }, drawn.map((c) => c.box)),
    el("h2", {}, "Tokens SIS accepts and rejects most (Fig. 5)"),
    el("p", { class: "muted" }, tokens.records_scanned
      ? `over the newest ${tokens.records_scanned} SIS records${tokens.truncated ? " (older ones not read)" : ""}`
      : "no SIS records for this run"),
    el("div", { class: "columns" },
      tokenList("most-accepted", "most often accepted", tokens.most_accepted,
        (t) => `${t.accepted} accepted · ${t.rejected + t.outside} rejected`),
      tokenList("most-rejected", "most often rejected (in V_K or outside it)", tokens.most_rejected,
        (t) => `${t.rejected + t.outside} rejected (${t.outside} outside V_K) · ${t.accepted} accepted`)),
    el("h2", {}, "Trajectories"),
    filters(stats, () => refresh().catch(report)), count,
    el("table", { id: "trajectories" }, el("thead", {}, el("tr", {},
      ["id", "step", "source", "reward", "EM", "searches", "length", "finish", "answer"].map((h) => el("th", {}, h)))), body));
  drawn.forEach((c) => c.draw()); // after insertion: the canvases have their laid-out size now
  await refresh();
}
