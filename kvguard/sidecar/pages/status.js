// The status page: per engine, pool states over checkpoints, the latest verdict
// and its leaks, the trend, the drain prediction and the attribution probes.
//
// It reads the sidecar's own JSON API every REFRESH_MS and redraws only when
// the answer changed. Everything the engines or clients wrote (request ids,
// explanations, details) reaches the page as text through dom.js, never as HTML.

import { fmt, h, s, ticks } from "./dom.js";

const REFRESH_MS = (() => {
  const fromQuery = Number(new URLSearchParams(location.search).get("refresh")) * 1000;
  const ms = fromQuery || Number(document.body.dataset.refreshMs) || 2000;
  return Math.min(60000, Math.max(500, ms));
})();
const MAX_BARS = 64; // checkpoints drawn (and fetched) per engine
const MAX_LEAK_ROWS = 200;

// Bottom to top: leak states sit on the axis, where a small count is still visible.
const STATES = [
  ["orphaned", "orphaned"],
  ["held_by_finished", "held by finished"],
  ["active", "active"],
  ["cached", "cached"],
  ["free", "free"],
];

const $ = (id) => document.getElementById(id);

// The drain prediction's eta is +Inf when the workload does not drain; Python
// writes that as a bare Infinity token, which JSON.parse rejects. Quote such
// tokens (outside strings) and turn them back into numbers with num().
function parseJSON(text) {
  return JSON.parse(text.replace(/"(?:[^"\\]|\\.)*"|-?\bInfinity\b|\bNaN\b/g,
    (m) => (m[0] === '"' ? m : JSON.stringify(m))));
}

function num(v) {
  if (typeof v === "number") return v;
  if (typeof v === "string" && /^-?(Infinity|inf)$/i.test(v)) return v.startsWith("-") ? -Infinity : Infinity;
  if (v === "NaN") return NaN;
  return null;
}

async function getText(url, { missingAs = null } = {}) {
  const r = await fetch(url, { cache: "no-store", headers: { Accept: "application/json" } });
  if (r.status === 404 && missingAs !== null) return missingAs;
  if (!r.ok) throw new Error(`${url} answered HTTP ${r.status}`);
  return r.text();
}

const pad = (n) => String(n).padStart(2, "0");

function clock(unixSeconds) {
  const d = new Date(unixSeconds * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function duration(seconds) {
  const v = num(seconds);
  if (v === null || Number.isNaN(v)) return "—";
  if (v === Infinity) return "never";
  if (v < 60) return `${fmt(v, 1)} s`;
  if (v < 3600) return `${Math.floor(v / 60)} min ${pad(Math.floor(v % 60))} s`;
  return `${Math.floor(v / 3600)} h ${pad(Math.floor((v % 3600) / 60))} min`;
}

function ago(unixSeconds) {
  return h("span", { class: "ago", "data-ts": unixSeconds, text: `(${duration(Date.now() / 1000 - unixSeconds)} ago)` });
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n, i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${fmt(v, i ? 1 : 0)} ${units[i]}`;
}

const words = (key) => key.replaceAll("_", " ");
const badge = (kind, value, label) =>
  h("span", { class: `badge ${kind}-${value}`, "data-testid": `${kind}-badge`, text: label ?? words(value) });

// ---- pool chart ----------------------------------------------------------

function poolChart(history) {
  const bars = history.filter((r) => r.pool).slice(-MAX_BARS);
  if (!bars.length) return h("p", { class: "empty", text: "No checkpoint with pool counts yet." });
  // Drawn at about its displayed size, so that 12-unit text is 12 px.
  const W = 600, H = 270, L = 58, R = 12, T = 34, B = 44;
  const capacity = Math.max(1, ...bars.map((r) => r.pool.capacity));
  const yTicks = ticks(capacity).filter((v) => v <= capacity * 0.93);
  const slot = (W - L - R) / Math.max(bars.length, 10);
  const bw = Math.max(2, Math.min(30, slot * 0.75));
  const y = (v) => T + (1 - v / capacity) * (H - T - B);
  const xc = (i) => L + slot * (i + 0.5);
  const labelEvery = Math.ceil(bars.length / 8);
  return s("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot pool", role: "img",
                    "aria-label": `pool states at the last ${bars.length} checkpoints` },
    yTicks.map((v) => s("g", { class: "tick" },
      s("line", { x1: L, x2: W - R, y1: y(v), y2: y(v) }),
      s("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", text: fmt(v) }))),
    s("line", { class: "capacity", x1: L, x2: W - R, y1: y(capacity), y2: y(capacity) }),
    s("text", { class: "capacity", x: L - 6, y: y(capacity) + 4, "text-anchor": "end", text: capacity },
      s("title", { text: "capacity (usable blocks)" })),
    s("text", { class: "axis-label", x: L - 6, y: T - 14, "text-anchor": "end", text: "verdict" }),
    s("text", { class: "axis-label", x: 12, y: (T + H - B) / 2, "text-anchor": "middle",
                transform: `rotate(-90 12 ${(T + H - B) / 2})`, text: "blocks" }),
    s("text", { class: "axis-label", x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle",
                text: "checkpoint (oldest → newest)" }),
    bars.map((r, i) => {
      let base = 0;
      const tip = [`checkpoint #${r.checkpoint_id} · ${clock(r.taken_at)} · ${r.verdict}` +
                   (r.evidence === "online" ? " (online audit, under load)"
                    : r.drained ? " (drained)" : " (not drained)"),
                   ...STATES.map(([k, label]) => `${label}: ${r.pool[k]}`),
                   `capacity: ${r.pool.capacity}`].join("\n");
      const restart = i > 0 && bars[i - 1].epoch !== r.epoch;
      return s("g", { class: "bar", "data-checkpoint": r.checkpoint_id },
        s("title", { text: tip }),
        restart ? s("line", { class: "restart", x1: xc(i) - slot / 2, x2: xc(i) - slot / 2, y1: T, y2: y(0) }) : null,
        STATES.map(([k]) => {
          const v = r.pool[k] || 0;
          const rect = s("rect", { class: `st-${k}`, x: xc(i) - bw / 2, y: y(base + v), width: bw,
                                   height: Math.max(0, y(base) - y(base + v)) });
          base += v;
          return v ? rect : null;
        }),
        s("circle", { class: `mark v-${r.verdict}`, cx: xc(i), cy: T - 18, r: Math.min(6, bw / 2) }),
        i % labelEvery === 0 || i === bars.length - 1
          ? s("text", { class: "tick", x: xc(i), y: y(0) + 16, "text-anchor": "middle", text: `#${r.checkpoint_id}` })
          : null);
    }),
    s("line", { class: "axis", x1: L, x2: W - R, y1: y(0), y2: y(0) }));
}

function legend(pool) {
  return h("div", { class: "legends" },
    h("ul", { class: "legend", "data-testid": "pool-legend" },
      STATES.slice().reverse().map(([k, label]) => h("li", { "data-state": k },
        h("span", { class: `swatch st-${k}` }), `${label} `,
        h("b", { text: pool ? pool[k] : "—" }))),
      h("li", { class: "capacity" }, "of capacity ", h("b", { text: pool ? pool.capacity : "—" }))),
    h("ul", { class: "legend verdict-key" }, h("li", { text: "verdict dots:" }),
      ["leak", "saturated", "clean", "skipped"].map((v) =>
        h("li", {}, h("span", { class: `dot v-${v}` }), v))));
}

// ---- sections ------------------------------------------------------------

function leaksTable(latest) {
  const leaks = latest?.leaks ?? [];
  if (!latest) return h("p", { class: "empty", text: "No checkpoint yet." });
  if (!leaks.length) {
    return h("p", { class: "empty", "data-testid": "no-leaks",
                    text: `No leaks at checkpoint #${latest.checkpoint_id}.` });
  }
  const rows = leaks.slice(0, MAX_LEAK_ROWS).map((l) => {
    const shown = l.client_request_id ?? l.request_id ?? "(unknown request)";
    return h("tr", { "data-testid": "leak-row" },
      h("td", { class: "request" },
        h("code", { "data-testid": "leak-request", text: shown }),
        l.request_id && l.request_id !== shown
          ? h("div", { class: "minor" }, "engine id ", h("code", { text: l.request_id })) : null,
        l.detail ? h("div", { class: "minor detail", text: l.detail }) : null),
      h("td", { "data-testid": "leak-cause" }, badge("cause", l.cause)),
      h("td", { "data-testid": "leak-path", text: words(l.path) }),
      h("td", { text: l.finish_reason ? words(l.finish_reason) : "—" }),
      h("td", { class: "num", "data-testid": "leak-blocks",
                text: l.shared_blocks ? `${l.blocks} (${l.shared_blocks} shared)` : l.blocks,
                title: l.block_ids?.length ? `block ids: ${l.block_ids.join(", ")}` : null }),
      h("td", { class: "num", "data-testid": "leak-held-for", text: duration(l.held_for_seconds) }),
      h("td", { text: l.evidence }));
  });
  // Distinct blocks, as the engine counted them: a prefix-shared block held by several
  // findings is one block of memory (summing the findings' counts would over-count it).
  const total = latest.leaked_blocks ?? 0;
  return h("div", { class: "table-wrap" },
    h("table", { class: "leaks", "data-testid": "leaks" },
      h("caption", { "data-testid": "leaks-caption",
                     text: `${leaks.length} finding${leaks.length === 1 ? "" : "s"}, ${total} distinct ` +
                           `block${total === 1 ? "" : "s"} leaked, at checkpoint #${latest.checkpoint_id}` }),
      h("thead", {}, h("tr", {}, ["request", "cause", "path", "finish", "blocks", "held for", "evidence"]
        .map((c) => h("th", { scope: "col", text: c })))),
      h("tbody", {}, rows)),
    leaks.length > MAX_LEAK_ROWS
      ? h("p", { class: "minor", text: `… and ${leaks.length - MAX_LEAK_ROWS} more in /v1/report.` }) : null);
}

function trendSection(trend) {
  if (!trend) return null;
  return h("section", { class: "panel trend", "data-testid": "trend" },
    h("h3", {}, "Trend ", badge("trend", trend.verdict)),
    h("p", { text: trend.explanation }),
    trend.holding_series?.length
      ? h("p", { class: "minor", text: `finished requests holding blocks at the last ${trend.checkpoints} ` +
                                        `drained checkpoints: ${trend.holding_series.join(" → ")}` })
      : null);
}

function drainSection(drain) {
  const body = [];
  if (!drain) {
    body.push(h("p", { class: "empty", text: "This engine publishes no drain prediction." }));
  } else {
    const eta = num(drain.eta_seconds);
    const drains = typeof drain.drains === "boolean" ? drain.drains : eta !== null && Number.isFinite(eta);
    const head = !drains ? "does not drain" : eta === 0 ? "drained now" : `drains in about ${duration(eta)}`;
    body.push(h("p", { class: `headline ${drains ? "ok" : "warn"}`, "data-testid": "drain-headline", text: head }));
    const known = {
      arrival_rate_per_s: ["λ arrivals", (v) => `${fmt(num(v))} /s`],
      completion_rate_per_s: ["μ completions", (v) => `${fmt(num(v))} /s`],
      backlog: ["backlog", (v) => `${v} requests`],
      eta_seconds: ["time to drain", (v) => duration(v)],
      window_seconds: ["measured over", (v) => duration(v)],
      at: ["estimated at", (v) => clock(num(v))],
    };
    body.push(h("dl", { class: "kv" }, Object.entries(known)
      .filter(([k]) => k in drain && drain[k] !== null)
      .map(([k, [label, f]]) => [h("dt", { text: label }), h("dd", { text: f(drain[k]) })])));
    if (drain.explanation) body.push(h("p", { "data-testid": "drain-explanation", text: drain.explanation }));
    const rest = Object.fromEntries(Object.entries(drain)
      .filter(([k]) => !(k in known) && !["drains", "explanation"].includes(k)));
    if (Object.keys(rest).length) body.push(fields(rest));
  }
  body.push(h("p", { class: "minor" }, "With arrivals at least as fast as completions a steady backlog is " +
    "ongoing work, not a leak; see the ", h("a", { href: "/lab", text: "queue lab" }), "."));
  return h("section", { class: "panel drain", "data-testid": "drain" }, h("h3", { text: "Drain prediction" }), body);
}

function value(key, v, depth) {
  if (v === null || v === undefined) return h("span", { class: "minor", text: "unknown" });
  if (typeof v === "number" && /_bytes$/.test(key)) return h("span", { title: `${v} bytes`, text: bytes(v) });
  if (typeof v === "number") return String(fmt(v, 3));
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (Array.isArray(v)) {
    return v.every((x) => x === null || typeof x !== "object") ? v.join(", ") : fields(v, depth + 1);
  }
  if (typeof v === "object") return fields(v, depth + 1);
  return String(v);
}

function fields(obj, depth = 0) {
  if (depth > 4) return h("code", { text: JSON.stringify(obj) });
  // Unmeasured fields (null, empty lists) are left out: the probes list what they
  // could not read in their own "unavailable" field.
  const entries = Object.entries(obj)
    .filter(([, v]) => v !== null && v !== undefined && !(Array.isArray(v) && v.length === 0));
  if (!entries.length) return h("span", { class: "minor", text: "nothing measured" });
  return h("dl", { class: "kv" }, entries.map(([k, v]) =>
    [h("dt", { text: typeof v === "number" ? words(k.replace(/_bytes$/, "")) : words(k) }),
     h("dd", {}, value(k, v, depth))]));
}

function signedBytes(v) {
  return typeof v === "number" ? `${v > 0 ? "+" : ""}${bytes(v)}` : "—";
}

// The attribution analysis (summary, findings with their next step), newer than
// the pool report: rendered when present, whatever extra fields it carries.
function attributionAnalysis(a) {
  if (a === null || typeof a !== "object") return h("p", { text: String(a) });
  const parts = [];
  if (a.status) parts.push(h("p", {}, badge("attribution-status", String(a.status))));
  if (a.summary) parts.push(h("p", { class: "summary", "data-testid": "attribution-summary", text: a.summary }));
  const findings = Array.isArray(a.findings) ? a.findings : [];
  if (findings.length && findings.every((f) => f && typeof f === "object")) {
    parts.push(h("div", { class: "table-wrap" }, h("table", { class: "findings", "data-testid": "findings" },
      h("thead", {}, h("tr", {}, ["boundary", "strength", "change", "evidence", "next step"]
        .map((c) => h("th", { scope: "col", text: c })))),
      h("tbody", {}, findings.map((f) => h("tr", { "data-testid": "finding-row" },
        h("td", { text: f.boundary ? words(String(f.boundary)) : "—" }),
        h("td", {}, f.strength ? badge("strength", String(f.strength)) : "—"),
        h("td", { class: "num", title: f.baseline_bytes != null && f.current_bytes != null
                    ? `${bytes(f.baseline_bytes)} → ${bytes(f.current_bytes)}` : null,
                  text: signedBytes(f.delta_bytes) }),
        h("td", { text: f.evidence ?? "" }),
        h("td", { text: f.next_step ?? "" })))))));
  }
  const rest = Object.fromEntries(Object.entries(a)
    .filter(([k]) => !["status", "summary", "findings"].includes(k)));
  if (Object.keys(rest).length) {
    parts.push(h("details", { class: "more" }, h("summary", { text: "how it was measured" }), fields(rest)));
  }
  return parts;
}

function attributionSection(latest) {
  const present = (k) => latest && latest[k] !== null && latest[k] !== undefined;
  const counters = ["allocator", "device", "host"].filter(present)
    .map((k) => h("div", { class: "attr", "data-testid": `attribution-${k}` },
      h("h4", { text: k }),
      typeof latest[k] === "object" ? fields(latest[k]) : h("p", { text: String(latest[k]) })));
  const body = [];
  if (present("attribution")) {
    body.push(h("div", { class: "analysis", "data-testid": "attribution-attribution" },
      attributionAnalysis(latest.attribution)));
  }
  if (counters.length) body.push(h("div", { class: "attr-grid" }, counters));
  return h("section", { class: "panel attribution", "data-testid": "attribution" },
    h("h3", { text: "Memory attribution (allocator, device, host)" }),
    body.length ? body : h("p", { class: "empty", text: "No attribution probes in this report." }));
}

function verdictSection(eng, latest) {
  if (!latest) {
    return h("section", { class: "verdict none", "data-testid": "verdict" },
      h("p", {}, badge("verdict", "none", "no checkpoint yet")),
      h("p", { text: "The engine has not taken a checkpoint in this epoch yet. One is taken at the next " +
                     "drained moment (nothing waiting or running)." }));
  }
  return h("section", { class: `verdict v-${latest.verdict}`, "data-testid": "verdict" },
    h("p", { class: "line" }, badge("verdict", latest.verdict),
      h("span", { class: "what" }, `checkpoint #${latest.checkpoint_id} · ${clock(latest.taken_at)} `,
        ago(latest.taken_at),
        latest.evidence === "online" ? " · online audit under load (ownership only)"
          : latest.drained ? " · drained" : " · not drained",
        latest.pool ? ` · prefix cache at ${fmt(100 * (latest.saturation_ratio ?? 0), 0)} % of capacity` : "")),
    latest.skip_reason ? h("p", { class: "skip", text: `skipped: ${latest.skip_reason}` }) : null,
    h("p", { class: "explanation", "data-testid": "explanation", text: latest.explanation }));
}

function onlineSection(online) {
  const body = [];
  if (!online) {
    body.push(h("p", { class: "empty", text: "Online audit off for this engine (KVGUARD_ONLINE_AUDIT=0)." }));
  } else if (!online.sweeps_total) {
    body.push(h("p", { class: "empty", text: "No sweep yet: the audit runs at engine steps." }));
  } else {
    const lat = num(online.detection_latency_seconds);
    const within = lat !== null && lat < 1 ? `${fmt(lat * 1000, 0)} ms` : duration(lat);
    body.push(h("p", { class: "headline ok", "data-testid": "online-headline",
                       text: `finds a leak within ${within} under load` }));
    body.push(h("p", { class: "minor", text:
      `${online.sweeps_total} sweeps; the last took ${online.last_sweep_steps} steps ` +
      `(${fmt(num(online.last_sweep_seconds), 2)} s), budget ${fmt(100 * num(online.budget_fraction), 1)} % ` +
      `of scheduler time; ${online.pending_blocks} block(s) awaiting a second look, ` +
      `${online.confirmed_blocks} confirmed.` }));
  }
  return h("section", { class: "panel online", "data-testid": "online" },
    h("h3", { text: "Online audit (ownership under load)" }), body);
}

function costSection(cost) {
  if (!cost) return null;  // metering off (KVGUARD_COST_SAMPLE_EVERY_STEPS=0)
  const self = num(cost.self_seconds_total);
  const sched = num(cost.scheduler_seconds_total);
  const body = [];
  if (!cost.sampled_steps_total || !sched) {
    body.push(h("p", { class: "empty", text:
      `No step metered yet: ${cost.window_steps} steps in every ${cost.sample_every_steps} are.` }));
  } else {
    const share = self / sched;
    body.push(h("p", { class: "headline", "data-testid": "cost-headline",
                       text: `${fmt(100 * share, 1)} % of scheduler time (${fmt(1 / (1 - share), 3)}x)` }));
    body.push(h("p", { class: "minor", text:
      `kvguard's own time on the engine thread, metered over ${cost.sampled_steps_total} steps since ` +
      `the engine started (${cost.window_steps} in every ${cost.sample_every_steps}). Its share of a ` +
      `whole step depends on the model: a GPU step is mostly its forward pass.` }));
  }
  return h("section", { class: "panel cost", "data-testid": "cost" },
    h("h3", { text: "kvguard's own cost" }), body);
}

// The KV-event mirror check: what a router believes this engine caches, against its pool.
function kvEventsSection(kv) {
  if (!kv) return null;  // the engine publishes no KV events, or the sidecar does not watch them
  const bad = !["consistent", "pending"].includes(kv.verdict);
  const body = [h("p", { class: `headline${bad ? " bad" : " ok"}`, "data-testid": "kv-events-verdict",
                         text: kv.verdict.replace("_", " ") })];
  if (kv.verdict !== "pending") {
    body.push(h("p", { class: "minor", "data-testid": "kv-events-counts", text:
      `batch ${kv.seq}: pool ${kv.pool_blocks} block(s), mirror ${kv.mirror_blocks}; ` +
      `${kv.stale_blocks} stale, ${kv.missing_blocks} missing` }));
  }
  for (const [label, keys] of [["first stale", kv.first_stale], ["first missing", kv.first_missing]]) {
    if (keys?.length) {
      body.push(h("p", { class: "minor" }, `${label}: `,
        ...keys.map((k) => h("code", { class: "block-key", text: k }))));
    }
  }
  body.push(h("p", { class: "minor", text: kv.explanation }));
  return h("section", { class: "panel kv-events", "data-testid": "kv-events" },
    h("h3", { text: "KV-event mirror" }), body);
}

function engineCard(eng, history) {
  const latest = eng.latest ?? null;
  const drain = eng.drain ?? latest?.drain ?? null;
  return h("article", { class: "engine", "data-engine": eng.engine, "data-testid": "engine" },
    h("header", {},
      h("h2", {}, "engine ", h("code", { text: eng.engine })),
      badge("up", eng.up ? "yes" : "no", eng.up ? "up" : "down (state file stale)"),
      h("span", { class: "minor" }, "epoch ", h("code", { text: eng.epoch })),
      eng.hook_errors_total ? h("span", { class: "badge warn", text: `${eng.hook_errors_total} hook errors` }) : null,
      eng.faults_enabled?.length
        ? h("span", { class: "badge fault", text: `fault injection on: ${eng.faults_enabled.join(", ")}` }) : null),
    verdictSection(eng, latest),
    h("div", { class: "grid" },
      h("section", { class: `panel leaks-panel${latest?.leaks?.length ? " has-leaks" : ""}`,
                     "data-testid": "leaks-panel" },
        h("h3", { text: "Leaks" }), leaksTable(latest)),
      h("section", { class: "panel pool", "data-testid": "pool" },
        h("h3", { text: "Pool states per checkpoint" }), poolChart(history), legend(latest?.pool)),
      h("div", { class: "side" }, trendSection(eng.trend), drainSection(drain),
        onlineSection(eng.online), costSection(eng.cost), kvEventsSection(eng.kv_events)),
      attributionSection(latest)));
}

function render(report, histories) {
  const engines = report.engines ?? [];
  const byEngine = new Map(histories.map(([name, h]) => [name, h.checkpoints ?? []]));
  if (!engines.length) {
    $("engines").replaceChildren(h("article", { class: "engine empty", "data-testid": "no-engines" },
      h("h2", { text: "No engine yet" }),
      h("p", { text: "The sidecar has not read any engine state. Each vLLM engine with kvguard writes " +
                     "<run dir>/<engine>.json; this page shows it within one refresh once it appears." })));
    return;
  }
  $("engines").replaceChildren(...engines.map((e) => engineCard(e, byEngine.get(e.engine) ?? [])));
}

let lastSeen = null;

async function refresh() {
  try {
    // The last MAX_BARS checkpoints of each engine, not the whole history of all of them.
    const reportText = await getText("/v1/report");
    const names = (parseJSON(reportText).engines ?? []).map((e) => e.engine);
    const historyTexts = await Promise.all(names.map((name) =>
      getText(`/v1/checkpoints?engine=${encodeURIComponent(name)}&limit=${MAX_BARS}`,
              { missingAs: '{"checkpoints": []}' })));
    const seen = [reportText, ...historyTexts].join("\n");
    if (seen !== lastSeen) {
      render(parseJSON(reportText), names.map((name, i) => [name, parseJSON(historyTexts[i])]));
      lastSeen = seen;
      document.body.dataset.renderedAt = String(Date.now()); // for tests: when new data showed
    }
    for (const el of document.querySelectorAll(".ago")) {
      el.textContent = `(${duration(Date.now() / 1000 - Number(el.dataset.ts))} ago)`;
    }
    $("updated").textContent = `last read ${clock(Date.now() / 1000)}`;
    $("fetch-error").hidden = true;
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (err) {
    $("fetch-error").hidden = false;
    $("fetch-error").textContent = `could not read the sidecar (${err.message}); showing the last answer, retrying`;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

$("refresh-interval").textContent = `${fmt(REFRESH_MS / 1000, 1)} s`;
document.body.dataset.refreshMs = String(REFRESH_MS);
refresh();
