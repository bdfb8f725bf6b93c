// The server panel: polls GET /v1/status (falling back to parsing GET /metrics) and shows
// load, KV cache, hit rate, throughput, worker layout, batch invariance and speculation,
// with a live chart of throughput and KV usage.
//
// Every poll becomes one normalized snapshot (see `fromStatus` / `fromMetrics`), dispatched
// as a "status" event; a poll that reaches neither endpoint dispatches "offline".

import { authHeaders } from "./auth.js";
import { LiveChart } from "./chart.js";
import { el, setText, formatBytes, formatCount, formatPercent, formatRate } from "./dom.js";

const POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000;
const FETCH_TIMEOUT_MS = 3000;
const TIER_HITS_EVERY = 3;  // polls between /metrics reads for cache hits by tier

export class StatusPanel extends EventTarget {
  constructor(root) {
    super();
    this.root = root;
    this.find = (name) => root.querySelector(`[data-field="${name}"]`);
    this.chart = new LiveChart(root.querySelector("canvas"), [
      { key: "throughput", label: "throughput", color: "--chart-1", unit: "tok/s", max: "auto" },
      { key: "kvUsage", label: "KV usage", color: "--chart-2", unit: "%", max: 1 },
    ]);
    this.numPolls = 0;
    this.lastMetrics = null;  // {at, generated}: throughput from /metrics needs two reads
    this.timer = 0;
    this.isPolling = false;
  }

  start() {
    this.poll();
  }

  /** Polls now (after an answer ends, say) unless a poll is already under way. */
  refresh() {
    if (!this.isPolling) this.poll();
  }

  async poll() {
    clearTimeout(this.timer);
    this.isPolling = true;
    this.numPolls += 1;
    const snapshot = await this.read();
    this.isPolling = false;
    if (snapshot) {
      this.render(snapshot);
      this.dispatchEvent(new CustomEvent("status", { detail: snapshot }));
    } else {
      this.renderOffline();
      this.dispatchEvent(new CustomEvent("offline"));
    }
    this.timer = setTimeout(() => this.poll(), document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }

  async read() {
    const status = await fetchJson("/v1/status");
    const wantsMetrics = !status || this.numPolls % TIER_HITS_EVERY === 1;
    const metrics = wantsMetrics ? await fetchText("/metrics") : null;
    const parsed = metrics ? parsePrometheus(metrics) : null;
    if (parsed) this.tierHits = cachedByTier(parsed);
    if (status) return { ...fromStatus(status), tierHits: this.tierHits };
    if (!parsed) return null;
    const snapshot = fromMetrics(parsed, this.lastMetrics);
    this.lastMetrics = { at: performance.now(), generated: snapshot.generated };
    return { ...snapshot, tierHits: this.tierHits };
  }

  // ------------------------------------------------------------ rendering
  render(s) {
    this.root.dataset.state = s.status;
    setText(this.find("state"), s.status === "ok" ? "ready" : s.status);
    setText(this.find("model"), s.model || "—");
    setText(this.find("source"), `from ${s.source}`);
    setText(this.find("running"), formatCount(s.running));
    setText(this.find("waiting"), formatCount(s.waiting));
    setText(this.find("throughput"), formatRate(s.throughput));
    setText(this.find("hit-rate"), formatPercent(s.hitRate));
    this.renderKv(s);
    this.renderLayout(s);
    setText(this.find("batch-invariant"), s.batchInvariant ? "on" : "off");
    this.find("batch-invariant").dataset.on = String(Boolean(s.batchInvariant));
    this.renderSpeculation(s.speculation);
    this.renderTierHits(s.tierHits);
    this.chart.push({ throughput: s.throughput, kvUsage: s.kvUsage });
    setText(this.find("chart-throughput"), formatRate(s.throughput));
    setText(this.find("chart-kv"), formatPercent(s.kvUsage));
    this.chart.canvas.setAttribute("aria-label", `Live chart: throughput `
      + `${formatRate(s.throughput)}, KV usage ${formatPercent(s.kvUsage)}`);
  }

  renderOffline() {
    this.root.dataset.state = "offline";
    setText(this.find("state"), "unreachable");
    this.chart.push({ throughput: 0, kvUsage: 0 });
  }

  renderKv(s) {
    const blocks = s.kvBlocksTotal
      ? `${formatCount(s.kvBlocksUsed)} / ${formatCount(s.kvBlocksTotal)} blocks` : "";
    const rows = [kvRow("device", s.kvUsage, blocks)];
    for (const [tier, info] of Object.entries(s.kvTiers || {})) {
      if (tier === "device") continue;
      const detail = Number.isFinite(info.bytes) ? formatBytes(info.bytes) : "";
      rows.push(kvRow(tier, info.usage, detail));
    }
    this.find("kv").replaceChildren(...rows);
  }

  renderLayout(s) {
    const roles = Object.entries(s.layout || {});
    const split = roles.some(([role]) => role !== "unified");
    const parts = [];
    for (const role of ["unified", "prefill", "decode"]) {
      const count = s.layout?.[role];
      if (!count) continue;
      if (parts.length) parts.push(el("span", { class: "arrow", "aria-hidden": "true" }, "→"));
      parts.push(el("span", { class: `role ${role}` }, `${role} × ${count}`));
    }
    if (!parts.length) parts.push(el("span", { class: "muted" }, "no worker reported"));
    setText(this.find("layout-kind"), split ? "disaggregated" : "unified");
    this.find("layout").replaceChildren(...parts);
    this.find("workers").replaceChildren(...(s.workers || []).map(workerRow));
  }

  renderSpeculation(spec = {}) {
    const mode = spec.mode || "off";
    const text = mode === "off" ? "off"
      : spec.draft_proposed ? `${mode} · ${formatPercent(spec.acceptance_rate)} accepted`
      : `${mode} · no drafts yet`;
    setText(this.find("speculation"), text);
    this.find("speculation").dataset.on = String(mode !== "off");
  }

  renderTierHits(hits) {
    const entries = Object.entries(hits || {}).filter(([, n]) => n > 0);
    const total = entries.reduce((sum, [, n]) => sum + n, 0);
    const box = this.find("tier-hits");
    if (!total) {
      box.replaceChildren(el("span", { class: "muted" }, "no cache hits yet"));
      return;
    }
    const bar = el("div", { class: "stack", role: "img",
                            "aria-label": entries.map(([t, n]) => `${t} ${n} tokens`).join(", ") },
      ...entries.map(([tier, n]) => el("span", { class: `seg ${tier}`,
                                                 style: `flex-grow:${n / total}` })));
    const legend = el("div", { class: "legend" },
      ...entries.map(([tier, n]) => el("span", { class: `key ${tier}` },
                                       `${tier} ${formatCount(n)}`)));
    box.replaceChildren(bar, legend);
  }
}

// ================================================================ snapshots
/** /v1/status (frontend/server.py AppState.status) -> snapshot. */
function fromStatus(s) {
  return {
    source: "/v1/status", status: s.status, model: s.model, maxModelLen: s.max_model_len,
    running: s.running, waiting: s.waiting, kvUsage: s.kv_usage,
    kvBlocksUsed: s.kv_blocks_used, kvBlocksTotal: s.kv_blocks_total, hitRate: s.hit_rate,
    throughput: s.throughput_tokens_per_s, layout: s.layout || {}, workers: s.workers || [],
    batchInvariant: Boolean(s.batch_invariant), speculation: s.speculation || { mode: "off" },
    kvTiers: s.kv_tiers || null,
  };
}

/** Prometheus text of /metrics (frontend/metrics.py) -> snapshot; `previous` gives the rate. */
function fromMetrics(m, previous) {
  const generated = total(m, "duplex_generation_tokens_total");
  const seconds = previous ? (performance.now() - previous.at) / 1000 : 0;
  const prompt = total(m, "duplex_prompt_tokens_total");
  const cached = total(m, "duplex_cached_prompt_tokens_total");
  const proposed = total(m, "duplex_spec_draft_proposed_tokens_total");
  const accepted = total(m, "duplex_spec_draft_accepted_tokens_total");
  const layout = {};
  for (const { labels, value } of m.get("duplex_workers") || []) layout[labels.role] = value;
  return {
    source: "/metrics", status: total(m, "duplex_engine_ready") ? "ok" : "unavailable",
    model: null, running: total(m, "duplex_requests_running"),
    waiting: total(m, "duplex_requests_waiting"), kvUsage: total(m, "duplex_kv_cache_usage_ratio"),
    kvBlocksUsed: total(m, "duplex_kv_blocks_used"),
    kvBlocksTotal: total(m, "duplex_kv_blocks_total"),
    hitRate: prompt ? cached / prompt : 0,
    throughput: seconds > 0 ? Math.max(0, generated - previous.generated) / seconds : 0,
    generated, layout, workers: [], batchInvariant: total(m, "duplex_batch_invariant") > 0,
    speculation: { mode: proposed ? "on" : "off", draft_proposed: proposed,
                   draft_accepted: accepted, acceptance_rate: proposed ? accepted / proposed : 0 },
    kvTiers: null,
  };
}

function cachedByTier(m) {
  const hits = {};
  for (const { labels, value } of m.get("duplex_cached_prompt_tokens_total") || []) {
    hits[labels.tier || "device"] = value;
  }
  return hits;
}

/** Prometheus text exposition -> Map(name -> [{labels, value}]). */
export function parsePrometheus(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[key] = value;
    }
    if (!samples.has(match[1])) samples.set(match[1], []);
    samples.get(match[1]).push({ labels, value: Number(match[3]) });
  }
  return samples;
}

function total(m, name) {
  const values = (m.get(name) || []).map(({ value }) => value).filter(Number.isFinite);
  return values.reduce((sum, value) => sum + value, 0);
}

// ================================================================ helpers
async function fetchWithTimeout(path) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
  try {
    const response = await fetch(path, { cache: "no-store", signal: controller.signal,
                                        headers: authHeaders() });
    return response.ok ? response : null;
  } catch {
    return null;
  } finally {
    clearTimeout(timer);
  }
}

async function fetchJson(path) {
  const response = await fetchWithTimeout(path);
  try {
    return response ? await response.json() : null;
  } catch {
    return null;
  }
}

async function fetchText(path) {
  const response = await fetchWithTimeout(path);
  try {
    return response ? await response.text() : null;
  } catch {
    return null;
  }
}

function kvRow(tier, usage, detail) {
  const known = Number.isFinite(usage);
  const meter = el("div", { class: "meter", role: "meter", "aria-label": `${tier} KV usage`,
                            "aria-valuemin": 0, "aria-valuemax": 100,
                            "aria-valuenow": known ? Math.round(usage * 100) : null },
                   el("span", { style: `width:${known ? Math.min(usage, 1) * 100 : 0}%` }));
  return el("div", { class: "kv-row", "data-tier": tier },
            el("span", { class: "tier" }, tier), meter,
            el("span", { class: "pct" }, known ? formatPercent(usage) : "—"),
            detail ? el("span", { class: "detail" }, detail) : null);
}

function workerRow(w) {
  const lastExit = w.last_exit ? `, last exit: ${w.last_exit}` : "";
  const title = `pid ${w.pid ?? "—"}, ${w.restarts} restart(s)${lastExit}`;
  return el("li", { class: `worker ${w.state}`, title },
            el("span", { class: "dot", "aria-hidden": "true" }),
            `${w.id} · ${w.role} · ${w.state}`,
            w.restarts ? el("span", { class: "restarts" }, ` ↻${w.restarts}`) : null);
}
