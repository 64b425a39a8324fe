// DOM helpers. Every text from the store (model output, passages) goes in through textContent, never as HTML.

// el("td", {class: "num", dataset: {t: 3}, onclick: f}, child, "text", [more children])
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (Number.isInteger(value)) return String(value);
  return Math.abs(value) >= 1e5 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(2) : value.toFixed(digits);
}

export function facts(pairs) {
  return el("dl", { class: "facts" }, pairs.map(([name, value]) => [el("dt", {}, name), el("dd", {}, value)]));
}

// A token's text as it should read in a list: quotes, with newlines and tabs visible.
export function shown(text) {
  return JSON.stringify(text);
}
