// Rendering of model output: markdown-it (CommonMark with GFM tables and strikethrough, raw
// HTML off, images off), highlight.js for fenced code, KaTeX through markdown-it-texmath for
// $…$, $$…$$, \(…\) and \[…\], then DOMPurify over the HTML, so nothing a model writes can run
// script (markdown-it already refuses javascript:/vbscript:/data: links; DOMPurify is the second
// wall). The libraries are vendored under web/vendor/ (see its README) and loaded by index.html
// as classic scripts before this module.
//
// `marks` are sorted, disjoint source ranges [{start, end, title}] to tint (tokens that came
// from accepted speculative drafts). Markdown syntax is gone from the rendered text, so each
// text node is found back in the source in order, and the parts of it inside a mark are wrapped.
//
// Streaming: `StreamRenderer` renders finished blocks once and re-renders only the tail (from
// the last blank line outside a code fence or a math block), so a long answer costs the same
// per frame as a short one; `finish` renders the whole text once, exactly.

const { markdownit, texmath, katex, hljs, DOMPurify } = window;

const md = markdownit({ html: false, linkify: true, typographer: false });
md.disable("image");  // a model's image link would make the browser fetch a URL it chose
md.use(texmath, { engine: katex, delimiters: ["dollars", "brackets"],
                  katexOptions: { throwOnError: false, trust: false, strict: "ignore" } });
md.renderer.rules.fence = (tokens, i) => codeBlock(tokens[i]);

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

/** Source text (+ marks, absolute; `offset`: where `source` starts in the whole text) ->
 * a sanitized DocumentFragment. */
export function renderMarkdown(source, marks = [], offset = 0) {
  const fragment = DOMPurify.sanitize(md.render(source), {
    RETURN_DOM_FRAGMENT: true, ADD_ATTR: ["target"], FORBID_TAGS: ["style", "form", "input"],
  });
  applyMarks(fragment, source, marks, offset);
  return fragment;
}

export class StreamRenderer {
  constructor(body) {
    this.body = body;
    this.done = document.createElement("div");  // finished blocks, rendered once
    this.tail = document.createElement("div");  // the block being written, re-rendered
    this.done.className = "md-done";
    this.tail.className = "md-tail";
    this.numDone = 0;  // chars of the text rendered into `done`
  }

  /** While streaming: render new finished blocks once, and the tail again. */
  update(text, marks) {
    if (this.done.parentNode !== this.body) this.body.replaceChildren(this.done, this.tail);
    const split = stableSplit(text, this.numDone);
    if (split > this.numDone) {
      this.done.append(renderMarkdown(text.slice(this.numDone, split), marks, this.numDone));
      this.numDone = split;
    }
    this.tail.replaceChildren(renderMarkdown(text.slice(this.numDone), marks, this.numDone));
  }

  /** At the end: the whole text in one pass (lists and references across blocks exact). */
  finish(text, marks) {
    this.body.replaceChildren(renderMarkdown(text, marks));
    this.numDone = 0;
  }
}

/** The end of the last blank line after `from` that is outside a fence or a $$ block: what
 * comes before it can no longer change its rendering (up to loose-list spacing). */
export function stableSplit(text, from = 0) {
  let fence = null;
  let inMath = false;
  let split = from;
  let at = from;
  for (const line of text.slice(from).split("\n")) {
    const end = at + line.length + 1;
    if (end > text.length) break;  // the last line is not finished yet
    const opener = /^ {0,3}(`{3,}|~{3,})/.exec(line);
    if (fence && opener && opener[1][0] === fence[0] && opener[1].length >= fence.length
        && !line.trim().slice(opener[1].length)) {
      fence = null;
    } else if (!fence && opener) {
      fence = opener[1];
    } else if (!fence && line.trim() === "$$") {
      inMath = !inMath;
    } else if (!fence && !inMath && !line.trim()) {
      split = end;
    }
    at = end;
  }
  return split;
}

function codeBlock(token) {
  const lang = token.info.trim().split(/\s+/)[0] || "";
  const code = token.content.replace(/\n$/, "");
  const escape = md.utils.escapeHtml;
  let html = escape(code);
  if (lang && hljs.getLanguage(lang)) {
    try {
      html = hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
    } catch {
      // keep the plain text
    }
  }
  const cls = lang ? `hljs language-${escape(lang)}` : "hljs";
  return `<figure class="code"><figcaption><span class="lang">${escape(lang || "text")}</span>`
    + `<button type="button" class="copy" data-action="copy">Copy</button></figcaption>`
    + `<pre><code class="${cls}">${html}</code></pre></figure>\n`;
}

/** Wraps the parts of text nodes that come from marked source ranges in span.drafted. */
function applyMarks(root, source, marks, offset) {
  const local = marks.map((m) => ({ ...m, start: m.start - offset, end: m.end - offset }))
    .filter((m) => m.end > 0 && m.start < source.length);
  if (!local.length) return;
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT, {
    acceptNode: (node) => (node.parentElement?.closest(".katex, figcaption")
      ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT),
  });
  const nodes = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) nodes.push(node);
  let cursor = 0;
  for (const node of nodes) {
    if (!node.data.trim()) continue;
    const at = source.indexOf(node.data, cursor);
    if (at < 0) continue;  // text not in the source as written (an entity, say): left plain
    cursor = at + node.data.length;
    wrapMarked(node, at, local);
  }
}

function wrapMarked(node, at, marks) {
  const text = node.data;
  const pieces = [];
  let pos = 0;
  for (const mark of marks) {
    const from = Math.max(mark.start - at, pos);
    const to = Math.min(mark.end - at, text.length);
    if (to <= from) continue;
    if (from > pos) pieces.push(text.slice(pos, from));
    const span = document.createElement("span");
    span.className = "drafted";
    span.title = mark.title;
    span.textContent = text.slice(from, to);
    pieces.push(span);
    pos = to;
  }
  if (!pieces.length) return;
  if (pos < text.length) pieces.push(text.slice(pos));
  node.replaceWith(...pieces);
}
