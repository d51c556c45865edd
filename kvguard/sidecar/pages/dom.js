// Small DOM helpers shared by the status page and the queue lab.
//
// Every piece of text goes into the page through textContent or an attribute
// value, never through innerHTML: request ids come from clients and must be
// shown as text, whatever characters they contain.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(el, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") el.textContent = String(value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** An HTML element: h("td", {class: "num"}, "text", otherNode). */
export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element, same calling convention as h(). */
export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

/** A number for people: at most `digits` decimals, no trailing zeros ("4", "2.5", "0.33"). */
export function fmt(x, digits = 2) {
  if (x === Infinity) return "∞";
  if (typeof x !== "number" || Number.isNaN(x)) return "—";
  const r = Number(x.toFixed(digits));
  return String(Object.is(r, -0) ? 0 : r);
}

/** Round numbers for an axis from 0 to about `max`: [0, step, 2·step, ...]. */
export function ticks(max, count = 4) {
  const span = Math.max(max, 1e-9);
  const raw = span / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((st) => st >= raw);
  const out = [];
  for (let v = 0; v <= span + step * 1e-6; v += step) out.push(Number(v.toFixed(10)));
  if (out[out.length - 1] < span - step * 1e-6) out.push(out[out.length - 1] + step);
  return out;
}
