// Small DOM and formatting helpers. Nothing here ever parses a string as HTML: text always
// lands in the page through text nodes, attributes through setAttribute.

/** el("p", {class: "x", "aria-label": "y"}, "text", childNode) -> a new element. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === false || value === null || value === undefined) continue;
    if (name === "class") node.className = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...children.filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

export function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

export function formatSeconds(s) {
  if (!Number.isFinite(s)) return "—";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
}

export function formatRate(perSecond) {
  if (!Number.isFinite(perSecond)) return "—";
  return `${perSecond >= 100 ? perSecond.toFixed(0) : perSecond.toFixed(1)} tok/s`;
}

export function formatPercent(ratio) {
  if (!Number.isFinite(ratio)) return "—";
  const pct = ratio * 100;
  return `${pct > 0 && pct < 10 ? pct.toFixed(1) : pct.toFixed(0)}%`;
}

export function formatCount(n) {
  return Number.isFinite(n) ? Math.round(n).toLocaleString("en-US") : "—";
}

export function formatBytes(n) {
  if (!Number.isFinite(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n >= 100 || i === 0 ? n.toFixed(0) : n.toFixed(1)} ${units[i]}`;
}
