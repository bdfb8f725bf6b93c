// Markdown-ish rendering of model output into inert DOM nodes.
//
// Model output is data, never markup: every character reaches the page through a text node,
// so `<script>` or `<b>` in an answer shows as those characters. Supported: fenced code
// blocks, headings, lists (nested by indentation), block quotes, rules, paragraphs, and inline
// `code`, **bold**, *italic* and [links](https://...) (http and https only).
//
// `marks` are sorted, disjoint source ranges [{start, end, title}] to highlight (tokens that
// came from accepted speculative drafts). Each text run is emitted with its offset in the
// source, so a mark survives whatever markup surrounds it.

import { el } from "./dom.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+/;
const RULE = /^ {0,3}([-*_])([ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?/;
const LIST_ITEM = /^([ \t]*)([-*+]|\d{1,9}[.)])[ \t]+/;
// Groups: 1 code, 2 bold (**), 3 bold (__), 4 italic, 5 link text, 6 link url.
const INLINE = new RegExp([
  "`([^`]+)`",
  "\\*\\*(?=\\S)(.+?)(?<=\\S)\\*\\*",
  "__(?=\\S)(.+?)(?<=\\S)__",
  "\\*(?=[^\\s*])(.+?)(?<=[^\\s*])\\*",
  "\\[([^\\]]+)\\]\\((https?://[^\\s)]+)\\)",
].join("|"), "dg");

/** Source text (+ marks) -> a DocumentFragment of inert nodes. */
export function renderMarkdown(source, marks = []) {
  return new Renderer(marks).render(source);
}

class Renderer {
  constructor(marks) {
    this.marks = marks;
  }

  render(source) {
    const root = document.createDocumentFragment();
    const lines = splitLines(source);
    let i = 0;
    while (i < lines.length) {
      i = isBlank(lines[i].text) ? i + 1 : this.block(root, lines, i);
    }
    return root;
  }

  /** Renders the block starting at line i; returns the index of the line after it. */
  block(parent, lines, i) {
    const text = lines[i].text;
    if (FENCE.test(text)) return this.codeBlock(parent, lines, i);
    if (HEADING.test(text)) return this.heading(parent, lines, i);
    if (RULE.test(text)) {
      parent.append(el("hr"));
      return i + 1;
    }
    if (QUOTE.test(text)) return this.quote(parent, lines, i);
    if (LIST_ITEM.test(text)) return this.list(parent, lines, i);
    return this.paragraph(parent, lines, i);
  }

  codeBlock(parent, lines, i) {
    const [, fence, lang] = FENCE.exec(lines[i].text);
    const code = el("code");
    let j = i + 1;
    for (; j < lines.length && !closesFence(lines[j].text, fence); j += 1) {
      if (j > i + 1) this.text(code, "\n", lines[j].start - 1);
      this.text(code, lines[j].text, lines[j].start);
    }
    const caption = el("figcaption", {},
      el("span", { class: "lang" }, lang || "text"),
      el("button", { type: "button", class: "copy", "data-action": "copy",
                     "aria-label": "Copy code" }, "Copy"));
    parent.append(el("figure", { class: "code" }, caption, el("pre", {}, code)));
    return j + 1;  // past the closing fence (an unclosed block runs to the end)
  }

  heading(parent, lines, i) {
    const { text, start } = lines[i];
    const match = HEADING.exec(text);
    const level = Math.min(match[1].length + 2, 6);  // answers live under the page's h1/h2
    const heading = el(`h${level}`);
    this.inline(heading, text.slice(match[0].length), start + match[0].length);
    parent.append(heading);
    return i + 1;
  }

  quote(parent, lines, i) {
    const paragraph = el("p");
    let j = i;
    for (; j < lines.length && QUOTE.test(lines[j].text); j += 1) {
      const { text, start } = lines[j];
      const prefix = QUOTE.exec(text)[0].length;
      if (j > i) this.text(paragraph, "\n", start - 1);
      this.inline(paragraph, text.slice(prefix), start + prefix);
    }
    parent.append(el("blockquote", {}, paragraph));
    return j;
  }

  list(parent, lines, i) {
    const stack = [];  // open lists, outermost first: {indent, ordered, list, item}
    let j = i;
    while (j < lines.length) {
      const { text, start } = lines[j];
      const match = LIST_ITEM.exec(text);
      if (match) {
        const item = el("li");
        this.openList(parent, stack, match).list.append(item);
        stack.at(-1).item = item;
        this.inline(item, text.slice(match[0].length), start + match[0].length);
        j += 1;
      } else if (isBlank(text)) {
        const next = nextNonBlank(lines, j);
        if (next >= lines.length || !LIST_ITEM.test(lines[next].text)) break;
        j = next;  // a loose list: blank lines between items
      } else if (/^[ \t]+\S/.test(text)) {  // an indented line continues the last item
        const lead = /^[ \t]+/.exec(text)[0].length;
        const item = stack.at(-1).item;
        this.text(item, "\n", start - 1);
        this.inline(item, text.slice(lead), start + lead);
        j += 1;
      } else {
        break;
      }
    }
    return j;
  }

  /** The list an item with this marker belongs in: nested, a sibling, or a new one. */
  openList(parent, stack, match) {
    const indent = match[1].replace(/\t/g, "    ").length;
    const ordered = /\d/.test(match[2]);
    while (stack.length > 1 && indent < stack.at(-1).indent) stack.pop();
    const top = stack.at(-1);
    if (top && indent < top.indent + 2 && top.ordered === ordered) return top;
    const nests = top && indent >= top.indent + 2;
    if (top && !nests) stack.pop();  // same level, other kind of marker: a new list
    const list = el(ordered ? "ol" : "ul");
    const first = parseInt(match[2], 10);
    if (ordered && first !== 1) list.setAttribute("start", String(first));
    const container = nests ? top.item : stack.length ? stack.at(-1).item : parent;
    container.append(list);
    const entry = { indent, ordered, list, item: null };
    stack.push(entry);
    return entry;
  }

  paragraph(parent, lines, i) {
    const paragraph = el("p");
    let j = i;
    for (; j < lines.length && !isBlank(lines[j].text); j += 1) {
      if (j > i && startsBlock(lines[j].text)) break;
      if (j > i) this.text(paragraph, "\n", lines[j].start - 1);
      this.inline(paragraph, lines[j].text, lines[j].start);
    }
    parent.append(paragraph);
    return j;
  }

  /** Inline markup of one line's text, which starts at `offset` in the source. */
  inline(parent, text, offset) {
    let last = 0;
    for (const match of text.matchAll(INLINE)) {
      if (match.index > last) this.text(parent, text.slice(last, match.index), offset + last);
      parent.append(this.span(match, offset));
      last = match.index + match[0].length;
    }
    if (last < text.length) this.text(parent, text.slice(last), offset + last);
  }

  span(match, offset) {
    const at = (group) => offset + match.indices[group][0];
    if (match[1] !== undefined) {
      const code = el("code");
      this.text(code, match[1], at(1));
      return code;
    }
    const group = [2, 3, 4, 5].find((g) => match[g] !== undefined);
    const node = group === 4 ? el("em")
      : group === 5 ? el("a", { href: match[6], target: "_blank",
                                rel: "noopener noreferrer nofollow" })
      : el("strong");
    this.inline(node, match[group], at(group));
    return node;
  }

  /** Appends plain text (as text nodes), wrapping the parts inside marks in spans. */
  text(parent, text, offset) {
    const marks = this.marks;
    let pos = 0;
    for (let k = firstMarkAfter(marks, offset); pos < text.length; k += 1) {
      const mark = marks[k];
      if (!mark || mark.start >= offset + text.length) {
        parent.append(text.slice(pos));
        return;
      }
      const from = Math.max(mark.start - offset, pos);
      const to = Math.min(mark.end - offset, text.length);
      if (from > pos) parent.append(text.slice(pos, from));
      parent.append(el("span", { class: "drafted", title: mark.title }, text.slice(from, to)));
      pos = to;
    }
  }
}

function splitLines(source) {
  const lines = [];
  let start = 0;
  for (;;) {
    const end = source.indexOf("\n", start);
    if (end < 0) {
      lines.push({ text: source.slice(start), start });
      return lines;
    }
    lines.push({ text: source.slice(start, end), start });
    start = end + 1;
  }
}

function isBlank(text) {
  return !/\S/.test(text);
}

function nextNonBlank(lines, j) {
  while (j < lines.length && isBlank(lines[j].text)) j += 1;
  return j;
}

function startsBlock(text) {
  return FENCE.test(text) || HEADING.test(text) || RULE.test(text) || QUOTE.test(text)
    || LIST_ITEM.test(text);
}

function closesFence(text, fence) {
  const match = /^ {0,3}(`{3,}|~{3,})[ \t]*$/.exec(text);
  return match !== null && match[1][0] === fence[0] && match[1].length >= fence.length;
}

/** Index of the first mark that ends after `offset` (marks are sorted and disjoint). */
function firstMarkAfter(marks, offset) {
  let lo = 0;
  let hi = marks.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (marks[mid].end <= offset) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}
