// The queue lab: q(t) = max(0, q0 + (λ − μ)·t), stepped by hand or on a timer.
//
// The only state is the number of steps taken (t = steps · STEP_SECONDS).
// q is never accumulated: it is computed from q0 at t = 0 and the current
// constant rates, so editing λ, μ or q0 keeps t and recomputes the trajectory.

import { fmt, s, ticks } from "./dom.js";

const STEP_SECONDS = 0.5;
const PLAY_INTERVAL_MS = 500;
const MAX_STEPS = 2000; // Play stops by itself at t = 1000 s.

const $ = (id) => document.getElementById(id);
const inputs = { lambda: $("lambda"), mu: $("mu"), q0: $("q0") };
const NAMES = { lambda: "λ", mu: "μ", q0: "q0" };

let steps = 0;
let timer = null;

function readInputs() {
  const values = {};
  const errors = [];
  for (const [key, el] of Object.entries(inputs)) {
    const v = el.value.trim() === "" ? NaN : Number(el.value);
    const ok = Number.isFinite(v) && v >= 0;
    el.setAttribute("aria-invalid", ok ? "false" : "true");
    if (!ok) errors.push(`${NAMES[key]} must be a number ≥ 0`);
    values[key] = v;
  }
  return { ...values, errors };
}

export function backlog(q0, lambda, mu, t) {
  return Math.max(0, q0 + (lambda - mu) * t);
}

function prediction({ lambda, mu, q0 }) {
  if (lambda < mu) {
    const at = q0 / (mu - lambda);
    return q0 === 0
      ? "Prediction: drained already (q0 = 0), and stays drained while λ < μ"
      : `Prediction: drains at t=${fmt(at)} s (q0 / (μ − λ) = ${fmt(q0)} / ${fmt(mu - lambda)})`;
  }
  if (lambda === mu) {
    return `Prediction: stays at ${fmt(q0)} (λ = μ: a steady backlog is ongoing work, not a leak)`;
  }
  return `Prediction: grows without bound (q rises by ${fmt(lambda - mu)} per s): does not drain`;
}

function chart({ lambda, mu, q0 }, t) {
  const W = 640, H = 300, L = 56, R = 20, T = 14, B = 44;
  const horizon = Math.max(8, Math.ceil((t + 2) / 2) * 2);
  const drainAt = lambda < mu && q0 > 0 ? q0 / (mu - lambda) : null;
  const yTicks = ticks(Math.max(1, q0, backlog(q0, lambda, mu, horizon)));
  const xTicks = ticks(horizon, 8);
  const yMax = yTicks[yTicks.length - 1] * 1.08; // headroom: a steady line is not drawn on the frame
  const xMax = xTicks[xTicks.length - 1];
  const x = (v) => L + (v / xMax) * (W - L - R);
  const y = (v) => T + (1 - v / yMax) * (H - T - B);
  const path = (t0, t1) => {
    const pts = [t0];
    if (drainAt !== null && drainAt > t0 && drainAt < t1) pts.push(drainAt);
    pts.push(t1);
    return pts.map((v) => `${x(v).toFixed(1)},${y(backlog(q0, lambda, mu, v)).toFixed(1)}`).join(" ");
  };
  const q = backlog(q0, lambda, mu, t);
  return s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "plot",
                    "aria-label": `q(t) from t=0 to t=${fmt(xMax)} s; now q=${fmt(q)} at t=${fmt(t)} s` },
    yTicks.map((v) => s("g", { class: "tick" },
      s("line", { x1: L, x2: W - R, y1: y(v), y2: y(v) }),
      s("text", { x: L - 8, y: y(v) + 4, "text-anchor": "end", text: fmt(v) }))),
    xTicks.map((v) => s("text", { class: "tick", x: x(v), y: H - B + 18, "text-anchor": "middle", text: fmt(v) })),
    s("line", { class: "axis", x1: L, x2: W - R, y1: y(0), y2: y(0) }),
    s("line", { class: "axis", x1: L, x2: L, y1: T, y2: y(0) }),
    s("text", { class: "axis-label", x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", text: "t (s)" }),
    s("text", { class: "axis-label", x: 14, y: (T + H - B) / 2, "text-anchor": "middle",
                transform: `rotate(-90 14 ${(T + H - B) / 2})`, text: "q (requests)" }),
    drainAt !== null && drainAt <= xMax
      ? s("g", { class: "drain-mark" },
          s("line", { x1: x(drainAt), x2: x(drainAt), y1: T, y2: y(0) }),
          s("text", { x: x(drainAt) + 6, y: T + 12, text: `drains at t=${fmt(drainAt)} s` }))
      : null,
    s("polyline", { class: "ahead", points: path(0, xMax) }),
    t > 0 ? s("polyline", { class: "done", points: path(0, t) }) : null,
    s("circle", { class: "now", cx: x(t), cy: y(q), r: 5 },
      s("title", { text: `t=${fmt(t)} s, q=${fmt(q)}` })));
}

function render() {
  const v = readInputs();
  const t = steps * STEP_SECONDS;
  const err = $("input-error");
  $("t").textContent = fmt(t);
  $("t").dataset.value = String(t);
  if (v.errors.length) {
    err.hidden = false;
    err.textContent = v.errors.join("; ");
    $("q").textContent = "—";
    delete $("q").dataset.value;
    $("prediction").textContent = "";
    $("chart").replaceChildren();
    return;
  }
  err.hidden = true;
  const q = backlog(v.q0, v.lambda, v.mu, t);
  $("q").textContent = fmt(q);
  $("q").dataset.value = String(q);
  const p = $("prediction");
  p.textContent = prediction(v);
  p.dataset.kind = v.lambda < v.mu ? "drains" : v.lambda === v.mu ? "steady" : "grows";
  $("chart").replaceChildren(chart(v, t));
}

function step() {
  if (steps < MAX_STEPS) steps += 1;
  else pause();
  render();
}

function pause() {
  if (timer !== null) clearInterval(timer);
  timer = null;
  $("play").textContent = "Play";
  $("play").setAttribute("aria-pressed", "false");
}

function play() {
  timer = setInterval(step, PLAY_INTERVAL_MS);
  $("play").textContent = "Pause";
  $("play").setAttribute("aria-pressed", "true");
}

$("reset").addEventListener("click", () => { pause(); steps = 0; render(); });
$("step").addEventListener("click", step);
$("play").addEventListener("click", () => (timer === null ? play() : pause()));
for (const el of Object.values(inputs)) el.addEventListener("input", render);
$("controls").addEventListener("submit", (e) => e.preventDefault());
render();
document.body.dataset.ready = "true";
