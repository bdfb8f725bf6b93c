// The conversation view: user turns, streamed answers with their live statistics, notices.
//
// An AnswerView owns one answer: the text so far, the source ranges of tokens that came from
// accepted speculative drafts, and the counters shown under it. It re-renders at most once
// per animation frame however fast deltas arrive, and then only the block being written
// (markdown.js StreamRenderer); the whole answer is rendered once more when it ends.

import { el, setText, formatCount, formatPercent, formatRate, formatSeconds } from "./dom.js";
import { StreamRenderer } from "./markdown.js";

const DRAFT_TITLE = "From an accepted speculative draft";
const STICKY_PX = 80;  // this close to the bottom, the view follows new text

export class ChatView {
  /** `onAction(action, index, detail)`: "edit" (detail: the new text) or "regenerate", for
   * the message at `index` of the conversation. */
  constructor(root, emptyState, onAction = () => {}) {
    this.root = root;
    this.emptyState = emptyState;
    this.onAction = onAction;
    root.addEventListener("click", (event) => {
      copyCode(event);
      this.messageAction(event);
    });
  }

  clear() {
    this.root.replaceChildren(this.emptyState);
    this.emptyState.hidden = false;
  }

  addUser(text, index) {
    const bubble = el("div", { class: "bubble" }, text);
    const article = el("article", { class: "msg user", "aria-label": "You", "data-index": index },
                       bubble, messageActions(["edit", "Edit"], ["copy-message", "Copy"]));
    this.append(article);
  }

  addAnswer(index) {
    const article = el("article", { class: "msg assistant", "aria-label": "Duplex answer",
                                    "data-index": index });
    const view = new AnswerView(article, () => this.follow());
    article.answer = view;
    this.append(article);
    return view;
  }

  messageAction(event) {
    const button = event.target.closest("[data-msg-action]");
    const article = button?.closest("article.msg");
    if (!article) return;
    const action = button.dataset.msgAction;
    const index = Number(article.dataset.index);
    if (action === "copy-message") {
      const text = article.answer ? article.answer.text
        : article.querySelector(".bubble").textContent;
      navigator.clipboard?.writeText(text).then(() => flash(button, "Copied"), () => {});
    } else if (action === "regenerate") {
      this.onAction("regenerate", index);
    } else if (action === "edit") {
      this.startEdit(article, index);
    }
  }

  /** Turns a user bubble into a box: Save sends the edited question from this point on. */
  startEdit(article, index) {
    const bubble = article.querySelector(".bubble");
    const box = el("textarea", { class: "edit-box", "aria-label": "Edit message", rows: 3 });
    box.value = bubble.textContent;
    const save = el("button", { type: "submit", class: "primary" }, "Save & send");
    const cancel = el("button", { type: "button", class: "ghost" }, "Cancel");
    const form = el("form", { class: "edit" }, box, el("div", { class: "edit-foot" }, cancel, save));
    bubble.hidden = true;
    article.querySelector(".msg-actions").hidden = true;
    article.prepend(form);
    box.focus();
    cancel.addEventListener("click", () => {
      form.remove();
      bubble.hidden = false;
      article.querySelector(".msg-actions").hidden = false;
    });
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (box.value.trim()) this.onAction("edit", index, box.value.trim());
    });
  }

  /** A line from the page itself (not the model), e.g. a connection problem. */
  addNotice(text, kind = "info") {
    this.append(el("div", { class: `notice ${kind}`, role: kind === "error" ? "alert" : "status" },
                   text));
  }

  append(node) {
    this.emptyState.hidden = true;
    const follow = this.isNearBottom();
    this.root.append(node);
    if (follow) this.scrollToEnd();
  }

  /** Keeps the newest text in view, unless the reader scrolled up to read. */
  follow() {
    if (this.isNearBottom(STICKY_PX * 3)) this.scrollToEnd();
  }

  isNearBottom(slack = STICKY_PX) {
    const { scrollHeight, scrollTop, clientHeight } = this.root;
    return scrollHeight - scrollTop - clientHeight < slack;
  }

  scrollToEnd() {
    this.root.scrollTop = this.root.scrollHeight;
  }
}

export class AnswerView {
  constructor(article, onRender) {
    this.article = article;
    this.onRender = onRender;
    this.sentAt = performance.now();
    this.firstTokenAt = 0;
    this.state = "streaming";  // -> done | stopped | error
    this.text = "";
    this.marks = [];  // [{start, end, title}], sorted and disjoint
    this.numTokens = 0;
    this.numProposed = 0;
    this.numAccepted = 0;
    this.renderPending = false;
    this.body = el("div", { class: "answer-body" }, thinkingDots());
    this.renderer = new StreamRenderer(this.body);
    this.reasoning = "";  // a reasoning model's thinking, shown apart (ReasoningView)
    this.reasoningView = null;
    this.problem = el("div", { class: "problem", role: "alert", hidden: true });
    this.stats = new AnswerStats();
    const avatar = el("div", { class: "avatar", "aria-hidden": "true" }, "D");
    this.actions = messageActions(["copy-message", "Copy"], ["regenerate", "Regenerate"]);
    this.actions.hidden = true;
    this.content = el("div", { class: "content" }, this.body, this.problem, this.stats.root,
                      this.actions);
    article.append(avatar, this.content);
    this.setState("streaming");
    this.stats.showLive(this);
  }

  get isStreaming() {
    return this.state === "streaming";
  }

  onDelta(frame) {
    if (frame.num_tokens > 0 && !this.firstTokenAt) this.firstTokenAt = performance.now();
    if (frame.reasoning) this.addReasoning(frame.reasoning);
    if (frame.text && this.reasoningView) this.reasoningView.finish();
    this.markDrafted(frame.text, frame.accepted_mask || []);
    this.text += frame.text;
    this.numTokens += frame.num_tokens;
    this.numProposed += frame.draft_proposed || 0;
    this.numAccepted += frame.draft_accepted || 0;
    this.stats.showLive(this);
    this.scheduleRender();
  }

  /** Thinking text: into its collapsible block, open while the model thinks. */
  addReasoning(text) {
    if (!this.reasoningView) {
      this.reasoningView = new ReasoningView();
      this.content.insertBefore(this.reasoningView.root, this.body);
    }
    this.reasoning += text;
    this.reasoningView.append(text);
    this.onRender();
  }

  onDone(frame) {
    if (this.reasoningView) this.reasoningView.finish();
    this.setState("done");
    this.stats.showDone(this, frame);
    this.render();  // at once: the final text is there when the state says "done"
  }

  /** An error frame: "cancelled" after our stop, anything else is a failure to show. */
  onError(frame) {
    const stopped = frame.code === "cancelled";
    this.setState(stopped ? "stopped" : "error");
    if (!stopped) {
      this.problem.replaceChildren(el("strong", {}, errorTitle(frame.code)), " ",
                                   el("span", { class: "code" }, frame.code), " ",
                                   el("span", { class: "message" }, frame.message));
      this.problem.hidden = false;
    }
    this.stats.showEnded(this, stopped ? "stopped" : "error");
    this.render();
  }

  /** A saved answer after a reload: its text and, if kept, the server's figures. */
  restore(text, final) {
    this.text = text;
    const stopped = !final || final.stopped;
    this.numTokens = stopped ? final?.num_tokens || 0 : final.usage.completion_tokens;
    this.setState(stopped ? "stopped" : "done");
    if (stopped) this.stats.showEnded(this, "stopped");
    else this.stats.showDone(this, final);
    this.render();
  }

  setState(state) {
    this.state = state;
    if (this.actions) this.actions.hidden = state === "streaming";
    this.article.dataset.state = state;
    this.article.setAttribute("aria-busy", String(state === "streaming"));
  }

  /** Marks this delta's accepted draft tokens. The protocol gives the text of a whole step,
   * not of each token, so the characters are shared between the step's tokens in order. */
  markDrafted(text, mask) {
    if (!text || !mask.includes(true)) return;
    const chars = Array.from(text);  // code points: never split a surrogate pair
    const unitOffset = [0];
    for (const c of chars) unitOffset.push(unitOffset.at(-1) + c.length);
    const base = this.text.length;
    mask.forEach((accepted, t) => {
      if (!accepted) return;
      const from = unitOffset[Math.round((t * chars.length) / mask.length)];
      const to = unitOffset[Math.round(((t + 1) * chars.length) / mask.length)];
      if (to > from) this.addMark(base + from, base + to);
    });
  }

  addMark(start, end) {
    const last = this.marks.at(-1);
    if (last && last.end === start) last.end = end;
    else this.marks.push({ start, end, title: DRAFT_TITLE });
  }

  scheduleRender() {
    if (this.renderPending) return;
    this.renderPending = true;
    requestAnimationFrame(() => {
      this.renderPending = false;
      this.render();
    });
  }

  render() {
    if (!this.text && this.isStreaming) return;  // the thinking dots stay
    if (this.isStreaming) this.renderer.update(this.text, this.marks);
    else this.renderer.finish(this.text, this.marks);
    if (!this.text && this.state !== "error") {
      this.body.append(el("p", { class: "empty-answer" }, "(no text)"));
    }
    if (this.isStreaming) lastTextBlock(this.body).append(el("span", { class: "caret",
                                                                      "aria-hidden": "true" }));
    this.onRender();
  }
}

/** A reasoning model's thinking: a <details> block above the answer, open and labelled
 * "Thinking…" while it streams, closed to "Thought" once the answer begins. Plain text
 * (never markdown, never HTML): what the model thinks is not rendered as the answer. */
class ReasoningView {
  constructor() {
    this.summary = el("summary", {}, "Thinking…");
    this.text = el("div", { class: "reasoning-text" });
    this.root = el("details", { class: "reasoning", open: true }, this.summary, this.text);
    this.isDone = false;
  }

  append(text) {
    this.text.append(document.createTextNode(text));
  }

  finish() {
    if (this.isDone) return;
    this.isDone = true;
    this.root.open = false;
    this.summary.textContent = "Thought";
  }
}

/** The statistics line under an answer: a <dl> of named figures, updated in place. */
class AnswerStats {
  static ITEMS = [["ttft", "TTFT"], ["speed", "Speed"], ["tokens", "Tokens"],
                  ["cache", "Cached prompt"], ["tiers", "By tier"], ["drafts", "Drafts accepted"],
                  ["e2e", "Total"], ["finish", "Finish"]];

  constructor() {
    this.root = el("dl", { class: "stats" });
    this.values = {};
    for (const [key, label] of AnswerStats.ITEMS) {
      const value = el("dd");
      this.values[key] = value;
      this.root.append(el("div", { class: "stat", "data-stat": key }, el("dt", {}, label), value));
    }
    this.item("cache").hidden = true;
    this.item("tiers").hidden = true;
    this.item("drafts").hidden = true;
    this.item("e2e").hidden = true;
  }

  item(key) {
    return this.values[key].parentElement;
  }

  set(key, text, title = "") {
    setText(this.values[key], text);
    if (title) this.values[key].title = title;
    this.item(key).hidden = false;
  }

  /** Client-side estimates while tokens arrive; the server's figures replace them at the end. */
  showLive(answer) {
    const now = performance.now();
    const first = answer.firstTokenAt;
    this.set("ttft", first ? formatSeconds((first - answer.sentAt) / 1000)
                           : formatSeconds((now - answer.sentAt) / 1000) + "…");
    const decodeMs = now - first;
    const rate = first && decodeMs > 50 ? ((answer.numTokens - 1) * 1000) / decodeMs : NaN;
    this.set("speed", Number.isFinite(rate) ? formatRate(rate) : "—");
    this.set("tokens", formatCount(answer.numTokens));
    this.showDrafts(answer.numProposed, answer.numAccepted);
    this.set("finish", "streaming…");
  }

  showDone(answer, frame) {
    const { usage, timings } = frame;
    this.set("ttft", formatSeconds(timings.ttft_s), "time to first token (server)");
    const decodeS = timings.e2e_s - timings.ttft_s;  // ~0 when one step brought every token
    this.set("speed", decodeS > 0.01 ? formatRate(timings.tokens_per_s) : "—",
             "decode speed after the first token");
    this.set("tokens", formatCount(usage.completion_tokens),
             `${usage.prompt_tokens} prompt + ${usage.completion_tokens} generated`);
    this.showCache(usage);
    this.showDrafts(answer.numProposed, answer.numAccepted);
    this.set("e2e", formatSeconds(timings.e2e_s), "end to end, as the server measured it");
    this.set("finish", frame.finish_reason + (frame.batch_invariant ? " · batch-invariant" : ""));
  }

  showEnded(answer, reason) {
    this.showLive(answer);
    if (!answer.firstTokenAt) this.set("ttft", "—");
    this.set("finish", reason);
  }

  showCache(usage) {
    const prompt = usage.prompt_tokens;
    const rate = prompt ? usage.cached_tokens / prompt : 0;
    const tiers = Object.entries(usage.cached_tokens_by_tier || {}).filter(([, n]) => n > 0);
    const byTier = tiers.map(([tier, n]) => `${tier} ${formatCount(n)}`).join(" · ");
    this.set("cache", `${formatCount(usage.cached_tokens)} / ${formatCount(prompt)} `
             + `(${formatPercent(rate)})`, "prompt tokens served from the KV cache");
    if (byTier) this.set("tiers", byTier, "cached prompt tokens by the tier they came from");
  }

  showDrafts(proposed, accepted) {
    if (!proposed) return;
    this.set("drafts", `${formatCount(accepted)} / ${formatCount(proposed)} `
             + `(${formatPercent(accepted / proposed)})`,
             "speculative draft tokens accepted / proposed; accepted text is tinted");
  }
}

function thinkingDots() {
  return el("p", { class: "thinking", "aria-label": "waiting for the first token" },
            el("span"), el("span"), el("span"));
}

/** Where the streaming caret goes: the last paragraph, item, heading or code block. */
function lastTextBlock(body) {
  const blocks = body.querySelectorAll("p, li, h3, h4, h5, h6, pre code");
  return blocks.length ? blocks[blocks.length - 1] : body;
}

function errorTitle(code) {
  return {
    connection_lost: "Connection lost.",
    unavailable: "The engine is unavailable.",
    overloaded: "The server is busy.",
    timeout: "The request timed out.",
    invalid_request: "The request was rejected.",
  }[code] || "Error.";
}

function messageActions(...actions) {
  return el("div", { class: "msg-actions" }, ...actions.map(([action, label]) =>
    el("button", { type: "button", class: "ghost small", "data-msg-action": action }, label)));
}

function flash(button, text) {
  const before = button.textContent;
  button.textContent = text;
  setTimeout(() => { button.textContent = before; }, 1500);
}

function copyCode(event) {
  const button = event.target.closest("[data-action=copy]");
  if (!button) return;
  const code = button.closest("figure")?.querySelector("code");
  if (!code || !navigator.clipboard) return;
  navigator.clipboard.writeText(code.textContent).then(() => {
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  }, () => {});
}
