// Small helpers shared by the trainmon tab's modules: requests to the plugin's routes, DOM nodes
// (text only ever set with textContent), select options and number formatting.

import { formatValue } from "./heatmap.js";

export const BASE = new URL("./", import.meta.url);

export function routeURL(route, params = {}) {
  const url = new URL(route, BASE);
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") url.searchParams.set(k, v);
  return url;
}

export async function getJSON(route, params = {}) {
  const response = await fetch(routeURL(route, params));
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function labelled(text, control) {
  const wrap = el("label", "tm-field");
  wrap.append(el("span", "tm-field-name", text), control);
  return wrap;
}

export function setOptions(select, options, value) {
  select.replaceChildren(...options.map(([v, text]) => {
    const option = el("option", "", text);
    option.value = String(v);
    return option;
  }));
  if (value !== undefined && options.some(([v]) => String(v) === String(value))) select.value = String(value);
}

// "1 row", "2 rows": a count with its noun.
export function plural(count, one, many = `${one}s`) {
  return `${count} ${count === 1 ? one : many}`;
}

// A value of the JSON answers: numbers, or the encoder's strings for non-finite ones.
export function formatAny(v) {
  if (v === null || v === undefined) return "?";
  if (v === "NaN") return "NaN";
  if (v === "Infinity") return "+Inf";
  if (v === "-Infinity") return "-Inf";
  return formatValue(v);
}
