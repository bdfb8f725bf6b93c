// The settings dialog: system prompt and sampling fields, kept in localStorage.
//
// `requestFields()` gives the sampling fields of a `chat` frame (frontend/protocol.py
// SamplingFields): the four main ones always, the ADVANCED ones (built into the dialog from
// the table below) only when set, so an unset field keeps the server's default. Every control
// shows its current value. The speculation switch is enabled only when /v1/status says the server
// takes a per-request choice (`speculation.per_request`); otherwise it shows the server's mode.

const STORAGE_KEY = "duplex.settings.v1";
// key, API field, kind, input attributes; null (an empty box) = not sent.
const ADVANCED = [
  ["topK", "top_k", "int", { min: 0, step: 1, placeholder: "off" }],
  ["minP", "min_p", "float", { min: 0, max: 1, step: 0.01, placeholder: "off" }],
  ["presencePenalty", "presence_penalty", "float", { min: -2, max: 2, step: 0.1, placeholder: "0" }],
  ["frequencyPenalty", "frequency_penalty", "float", { min: -2, max: 2, step: 0.1, placeholder: "0" }],
  ["repetitionPenalty", "repetition_penalty", "float", { min: 0.01, max: 2, step: 0.05, placeholder: "1" }],
  ["seed", "seed", "int", { step: 1, placeholder: "random" }],
  ["minTokens", "min_tokens", "int", { min: 0, step: 1, placeholder: "0" }],
  ["stop", "stop", "lines", { placeholder: "one stop string per line" }],
  ["cacheSalt", "cache_salt", "text", { placeholder: "none" }],
  ["retention", "retention", "choice", { choices: ["chat", "agent"] }],
  ["ignoreEos", "ignore_eos", "bool", {}],
  ["includeStop", "include_stop_str_in_output", "bool", {}],
  ["skipSpecial", "skip_special_tokens", "bool", { default: true }],
];
const ADVANCED_DEFAULTS = Object.fromEntries(ADVANCED.map(([key, , kind, attrs]) =>
  [key, kind === "bool" ? attrs.default === true : kind === "choice" ? attrs.choices[0] : null]));

export const DEFAULTS = Object.freeze({
  system: "", temperature: 0.7, topP: 0.9, maxTokens: 512, speculation: true,
  ...ADVANCED_DEFAULTS,
});

export class Settings {
  constructor(dialog) {
    this.dialog = dialog;
    this.form = dialog.querySelector("form");
    this.values = { ...DEFAULTS, ...load() };
    this.speculationAllowed = false;
    buildAdvanced(dialog.querySelector("[data-field=advanced]"));
    this.fill();
    this.form.addEventListener("input", () => this.read());
    dialog.querySelector("[data-action=reset]").addEventListener("click", () => {
      this.values = { ...DEFAULTS };
      this.fill();
      save(this.values);
    });
  }

  open() {
    this.dialog.showModal();
  }

  /** The sampling fields of the next chat frame. */
  requestFields() {
    const v = this.values;
    const fields = { temperature: v.temperature, top_p: v.topP };
    if (v.maxTokens !== null) fields.max_tokens = v.maxTokens;  // unset: the rest of the context
    if (this.speculationAllowed) fields.speculate = v.speculation;  // SamplingFields.speculate
    for (const [key, api] of ADVANCED) {
      const value = v[key];
      if (value === null || value === "" || value === ADVANCED_DEFAULTS[key]) continue;
      fields[api] = value;
    }
    return fields;
  }

  /** The system message to put first, or null. */
  systemMessage() {
    const text = this.values.system.trim();
    return text ? { role: "system", content: text } : null;
  }

  /** Adapts the controls to what the server reports (a /v1/status snapshot). */
  applyServer(snapshot) {
    const spec = snapshot.speculation || {};
    const mode = spec.mode || "off";
    this.speculationAllowed = mode !== "off" && spec.per_request === true;
    const toggle = this.form.elements.speculation;
    toggle.disabled = !this.speculationAllowed;
    toggle.checked = this.speculationAllowed ? this.values.speculation : mode !== "off";
    this.dialog.querySelector("[data-field=speculation-note]").textContent = mode === "off"
      ? "Off on this server (start it with --speculation ngram, draft or self)."
      : this.speculationAllowed ? `Server mode: ${mode}.`
      : `On for every request (server mode: ${mode}); this server takes no per-request switch.`;
    if (snapshot.maxModelLen) this.form.elements.maxTokens.max = String(snapshot.maxModelLen);
  }

  fill() {
    const { elements } = this.form;
    elements.system.value = this.values.system;
    elements.temperature.value = String(this.values.temperature);
    elements.topP.value = String(this.values.topP);
    elements.maxTokens.value = this.values.maxTokens === null ? "" : String(this.values.maxTokens);
    if (this.speculationAllowed) elements.speculation.checked = this.values.speculation;
    for (const [key, , kind] of ADVANCED) {
      const value = this.values[key];
      if (kind === "bool") elements[key].checked = value;
      else if (kind === "lines") elements[key].value = (value || []).join("\n");
      else elements[key].value = value === null ? "" : String(value);
    }
    this.showOutputs();
  }

  read() {
    const { elements } = this.form;
    const maxTokens = parseInt(elements.maxTokens.value, 10);
    this.values = {
      system: elements.system.value,
      temperature: Number(elements.temperature.value),
      topP: Number(elements.topP.value),
      maxTokens: Number.isFinite(maxTokens) && maxTokens >= 1 ? maxTokens : null,
      speculation: this.speculationAllowed ? elements.speculation.checked : this.values.speculation,
    };
    for (const [key, , kind] of ADVANCED) this.values[key] = readControl(elements[key], kind);
    this.showOutputs();
    save(this.values);
  }

  showOutputs() {
    for (const output of this.form.querySelectorAll("output[data-for]")) {
      output.value = Number(this.values[output.dataset.for]).toFixed(2);
    }
    for (const output of this.form.querySelectorAll("output[data-shows]")) {
      output.value = shownValue(this.values[output.dataset.shows], output.dataset.kind);
    }
  }
}

/** The advanced controls, one labelled row each with an <output> that shows the value. */
function buildAdvanced(root) {
  for (const [key, api, kind, attrs] of ADVANCED) {
    const label = document.createElement("label");
    label.className = kind === "bool" ? "field check" : "field";
    const title = document.createElement("span");
    const output = document.createElement("output");
    output.dataset.shows = key;
    output.dataset.kind = kind;
    title.append(api, " ", output);
    let control;
    if (kind === "choice") {
      control = document.createElement("select");
      for (const choice of attrs.choices) control.append(new Option(choice, choice));
    } else if (kind === "lines") {
      control = document.createElement("textarea");
      control.rows = 2;
    } else {
      control = document.createElement("input");
      control.type = kind === "bool" ? "checkbox" : kind === "text" ? "text" : "number";
    }
    control.name = key;
    for (const [name, value] of Object.entries(attrs)) {
      if (name !== "choices" && name !== "default") control.setAttribute(name, String(value));
    }
    label.append(title, control);
    root.append(label);
  }
}

function readControl(control, kind) {
  if (kind === "bool") return control.checked;
  if (kind === "choice" || kind === "text") return control.value || (kind === "text" ? null : control.value);
  if (kind === "lines") {
    const lines = control.value.split("\n").filter((line) => line !== "");
    return lines.length ? lines : null;
  }
  const number = kind === "int" ? parseInt(control.value, 10) : parseFloat(control.value);
  return Number.isFinite(number) ? number : null;
}

function shownValue(value, kind) {
  if (kind === "bool") return value ? "on" : "off";
  if (value === null || value === undefined) return "server default";
  if (kind === "lines") return value.map((line) => JSON.stringify(line)).join(", ");
  return String(value);
}

function load() {
  try {
    const stored = JSON.parse(localStorage.getItem(STORAGE_KEY) || "{}");
    return Object.fromEntries(Object.entries(stored).filter(([k, v]) =>
      k in DEFAULTS && (typeof v === typeof DEFAULTS[k] || v === null
                        || (k === "stop" && Array.isArray(v)))));
  } catch {
    return {};
  }
}

function save(values) {
  try {
    localStorage.setItem(STORAGE_KEY, JSON.stringify(values));
  } catch {
    // storage may be full or disabled: settings then last for this page only
  }
}
