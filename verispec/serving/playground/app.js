// verispec playground: streams a completion with per-token provenance ("verispec": {"provenance": true}) and
// shows how speculation committed each token. Plain JavaScript, no build step, nothing from other hosts.
"use strict";

const KEY_STORAGE = "verispec.apiKey"; // sessionStorage: the key stays in this tab, gone when it closes
const LABELS = {
  accepted: "drafted and kept by the target",
  recovered: "corrected by the target (a draft was rejected here)",
  bonus: "bonus token (every draft of the pass was kept)",
  plain: "target alone (no drafts in this pass)",
};

const $ = (id) => document.getElementById(id);
let modelName = null;
let running = null; // the AbortController of the request in flight
let view = null; // the run shown in the output area
let selected = -1; // the token inspected with the keyboard

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function headers(json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  if (apiKey()) out.Authorization = "Bearer " + apiKey();
  return out;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (error) {
    // not JSON: the status line says enough
  }
  return `HTTP ${response.status}`;
}

function authMessage(status) {
  if (status !== 401) return null;
  return apiKey()
    ? "The API key was not accepted (HTTP 401). Check it and enter it again above."
    : "This server needs an API key. Enter it above; it is kept in this tab only.";
}

function showAuth(message) {
  const box = $("auth-message");
  box.textContent = message || "";
  box.hidden = !message;
}

function setStatus(message, kind) {
  const box = $("status");
  box.textContent = message;
  box.className = "status" + (kind ? " " + kind : "");
}

function setState(state) {
  document.body.dataset.state = state;
  const busy = state === "running";
  $("generate").disabled = busy;
  $("compare").disabled = busy;
  $("stop").disabled = !busy;
}

// ---- connecting: the model's name, and whether the key is right

async function keyRequired() {
  const response = await fetch("/playground/settings.json");
  return response.ok && (await response.json()).api_key_required === true;
}

async function connect() {
  showAuth(null);
  let response;
  try {
    if (!apiKey() && (await keyRequired())) { // ask first: a request bound to fail helps nobody
      modelName = null;
      $("model-name").textContent = "(not connected)";
      showAuth(authMessage(401));
      document.body.dataset.auth = "refused";
      return false;
    }
    response = await fetch("/v1/models", { headers: headers(false) });
  } catch (error) {
    showAuth("Cannot reach the server: " + error.message);
    return false;
  }
  if (!response.ok) {
    modelName = null;
    $("model-name").textContent = "(not connected)";
    showAuth(authMessage(response.status) || (await errorMessage(response)));
    document.body.dataset.auth = "refused";
    return false;
  }
  const body = await response.json();
  modelName = body.data && body.data.length ? body.data[0].id : null;
  $("model-name").textContent = modelName || "(unknown)";
  document.body.dataset.auth = "ok";
  return true;
}

// ---- the request

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

function requestBody(draftOff) {
  const chat = document.querySelector('input[name="mode"]:checked').value === "chat";
  const prompt = $("prompt").value;
  const body = {
    max_tokens: Math.max(1, Math.round(numberField("max-tokens") || 1)),
    temperature: numberField("temperature") ?? 0,
    stream: true,
    stream_options: { include_usage: true },
    verispec: { provenance: true },
  };
  if (modelName) body.model = modelName;
  const topP = numberField("top-p");
  if (topP !== null && topP < 1) body.top_p = topP;
  const seed = numberField("seed");
  if (seed !== null) body.seed = Math.round(seed);
  const draft = draftOff ? "off" : $("draft").value;
  if (draft === "auto" || draft === "off") body.verispec.num_draft_tokens = draft;
  if (draft === "fixed") body.verispec.num_draft_tokens = Math.max(1, Math.round(numberField("draft-length") || 1));
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  return { path: chat ? "/v1/chat/completions" : "/v1/completions", body };
}

function newRun(shown) {
  return {
    shown, text: "", tokens: [], steps: new Map(), started: performance.now(), ended: null,
    finish: null, telemetry: null, rendered: 0,
  };
}

async function stream(path, body, run, signal) {
  const response = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!response.ok) throw new ApiError(response.status, await errorMessage(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(500, chunk.error.message);
        receive(run, chunk);
      }
    }
  }
}

function receive(run, chunk) {
  const extension = chunk.verispec || {};
  if (!chunk.choices.length) { // the usage chunk: the request's summed telemetry
    run.summary = extension;
    return;
  }
  for (const choice of chunk.choices) {
    const piece = choice.text ?? (choice.delta ? choice.delta.content : null) ?? "";
    run.text += piece;
    for (const token of extension.tokens || []) addToken(run, token);
    if (choice.finish_reason) {
      run.finish = choice.finish_reason;
      run.telemetry = extension;
      run.ended = performance.now();
      if (extension.error) run.error = extension.error;
    }
  }
  if (run.shown) {
    render(run);
    updateStrip(run);
  }
}

function addToken(run, token) {
  run.tokens.push(token);
  let step = run.steps.get(token.step);
  if (!step) {
    step = { drafted: token.drafted, accepted: 0 };
    run.steps.set(token.step, step);
  }
  if (token.kind === "accepted") step.accepted += 1;
}

// ---- the output: one span per token, its text read off the choice's text between offsets

function tokenText(run, index) {
  const start = run.tokens[index].offset;
  const end = index + 1 < run.tokens.length ? run.tokens[index + 1].offset : run.text.length;
  return run.text.slice(start, Math.max(start, end));
}

function describe(run, index) {
  const token = run.tokens[index];
  const text = tokenText(run, index);
  const logprob = token.logprob === null || token.logprob === undefined ? "n/a" : token.logprob.toFixed(3);
  const shown = text === "" ? "(no text: " + token.token + ")" : JSON.stringify(text);
  const drafted = token.tree ? `a tree of ${token.drafted} drafts` : `${token.drafted} drafted`;
  return `Token ${index + 1} ${shown}: ${LABELS[token.kind]}; target pass ${token.step + 1}` +
    ` (${drafted}); logprob ${logprob}`;
}

function render(run) {
  const output = $("output");
  // The last span's text can grow when more text arrives: redo it with the new ones.
  const from = Math.max(0, run.rendered - 1);
  while (output.children.length > from) output.lastChild.remove();
  for (let i = from; i < run.tokens.length; i++) {
    const span = document.createElement("span");
    const token = run.tokens[i];
    const text = tokenText(run, i);
    // A token with no text of its own: an end token (marked), or the first bytes of a character the next one ends.
    const end = text === "" && !token.token.startsWith("bytes:");
    span.className = "tok " + token.kind + (token.tree ? " tree" : "") + (end ? " empty" : "") +
      (i === selected ? " selected" : "");
    span.textContent = text;
    span.dataset.index = String(i);
    span.dataset.step = String(token.step);
    span.title = describe(run, i);
    output.appendChild(span);
  }
  run.rendered = run.tokens.length;
}

function clearOutput() {
  $("output").replaceChildren();
  $("positions").replaceChildren();
  selected = -1;
  $("token-info").textContent =
    "Hover a token, or focus the output and use the arrow keys, to see how it was committed.";
  for (const id of ["stat-tokens", "stat-passes"]) $(id).textContent = "0";
  for (const id of ["stat-per-pass", "stat-speed", "stat-acceptance"]) $(id).textContent = "–";
}

function speed(run) {
  const telemetry = run.telemetry;
  if (telemetry && telemetry.total_time_s) return telemetry.generated_tokens / telemetry.total_time_s;
  const end = run.ended ?? performance.now();
  const seconds = (end - run.started) / 1000;
  return seconds > 0 ? run.tokens.length / seconds : 0;
}

function updateStrip(run) {
  const passes = run.steps.size;
  const drafted = [...run.steps.values()].reduce((sum, s) => sum + s.drafted, 0);
  const accepted = [...run.steps.values()].reduce((sum, s) => sum + s.accepted, 0);
  $("stat-tokens").textContent = String(run.tokens.length);
  $("stat-passes").textContent = String(passes);
  $("stat-per-pass").textContent = passes ? (run.tokens.length / passes).toFixed(2) : "–";
  $("stat-speed").textContent = run.tokens.length ? speed(run).toFixed(1) : "–";
  $("stat-acceptance").textContent =
    drafted ? `${(100 * accepted / drafted).toFixed(0)}% (${accepted}/${drafted})` : "no drafts";
  const longest = Math.max(0, ...[...run.steps.values()].map((s) => s.drafted));
  const list = $("positions");
  list.replaceChildren();
  for (let position = 1; position <= longest; position++) {
    let proposed = 0;
    let kept = 0;
    for (const step of run.steps.values()) {
      if (step.drafted >= position) proposed += 1;
      if (step.accepted >= position) kept += 1;
    }
    const item = document.createElement("li");
    const label = document.createElement("span");
    const id = "position-" + position;
    label.id = id;
    label.textContent = `Draft ${position}: ${kept}/${proposed} kept`;
    const bar = document.createElement("progress");
    bar.max = Math.max(1, proposed);
    bar.value = kept;
    bar.setAttribute("aria-labelledby", id);
    item.append(label, bar);
    list.appendChild(item);
  }
}

// ---- inspecting tokens (mouse and keyboard)

function inspect(index) {
  if (!view || index < 0 || index >= view.tokens.length) return;
  const output = $("output");
  const previous = output.querySelector(".selected");
  if (previous) previous.classList.remove("selected");
  selected = index;
  const span = output.children[index];
  if (span) {
    span.classList.add("selected");
    span.scrollIntoView({ block: "nearest" });
  }
  $("token-info").textContent = describe(view, index);
}

function onOutputKey(event) {
  if (!view || !view.tokens.length) return;
  const moves = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 };
  let next = null;
  if (event.key in moves) next = (selected < 0 ? 0 : selected + moves[event.key]);
  if (event.key === "Home") next = 0;
  if (event.key === "End") next = view.tokens.length - 1;
  if (next === null) return;
  event.preventDefault();
  inspect(Math.min(view.tokens.length - 1, Math.max(0, next)));
}

function onOutputPointer(event) {
  const span = event.target.closest ? event.target.closest(".tok") : null;
  if (span && view && span.dataset.index !== undefined) {
    $("token-info").textContent = describe(view, Number(span.dataset.index));
  }
}

// ---- actions

async function execute(request, run) {
  running = new AbortController();
  try {
    if (!apiKey() && document.body.dataset.auth === "refused") throw new ApiError(401, "no API key");
    await stream(request.path, request.body, run, running.signal);
    return true;
  } catch (error) {
    if (error.name === "AbortError") {
      setStatus("Stopped.", "");
    } else if (error instanceof ApiError && error.status === 401) {
      showAuth(authMessage(401));
      setStatus("Not authorised: see the message above.", "error");
    } else {
      setStatus("Error: " + error.message, "error");
    }
    return false;
  } finally {
    running = null;
    if (run.shown) updateStrip(run);
  }
}

function finishedMessage(run) {
  if (run.error) return `Finished with an error: ${run.error}`;
  return `Done: ${run.tokens.length} tokens in ${run.steps.size} target passes (finish reason: ${run.finish}).`;
}

async function generate() {
  clearOutput();
  $("compare-panel").hidden = true;
  view = newRun(true);
  setState("running");
  setStatus("Generating…", "");
  const ok = await execute(requestBody(false), view);
  if (ok) setStatus(finishedMessage(view), view.error ? "error" : "");
  setState(ok ? "done" : "error");
  return ok ? view : null;
}

async function compare() {
  const speculative = await generate();
  if (!speculative) return;
  setState("running");
  setStatus("Running the same prompt with the draft off…", "");
  const base = newRun(false);
  const ok = await execute(requestBody(true), base);
  setState(ok ? "done" : "error");
  if (!ok) return;
  const panel = $("compare-panel");
  const passes = (run) => (run.steps.size ? (run.tokens.length / run.steps.size).toFixed(2) : "–");
  $("cmp-spec-tokens").textContent = String(speculative.tokens.length);
  $("cmp-spec-speed").textContent = speed(speculative).toFixed(1);
  $("cmp-spec-pass").textContent = passes(speculative);
  $("cmp-base-tokens").textContent = String(base.tokens.length);
  $("cmp-base-speed").textContent = speed(base).toFixed(1);
  $("cmp-base-pass").textContent = passes(base);
  const ratio = speed(base) > 0 ? speed(speculative) / speed(base) : 0;
  $("cmp-speedup").textContent = `Speculative decoding ran at ${ratio.toFixed(2)}x the target alone's speed.`;
  const identical = speculative.text === base.text;
  const greedy = (numberField("temperature") ?? 0) === 0;
  const verdict = $("cmp-identical");
  verdict.dataset.identical = String(identical);
  verdict.textContent = identical
    ? "The texts are identical."
    : "The texts differ" +
      (greedy ? " (unexpected under greedy decoding: near-ties can flip)." : " (expected when sampling).");
  verdict.className = "verdict " + (identical ? "same" : "different");
  $("cmp-base-text").textContent = base.text;
  panel.hidden = false;
  setStatus("Compared: " + verdict.textContent, "");
}

function init() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    connect();
  });
  $("prompt-form").addEventListener("submit", (event) => {
    event.preventDefault();
    generate();
  });
  $("compare").addEventListener("click", () => compare());
  $("stop").addEventListener("click", () => running && running.abort());
  $("draft").addEventListener("change", () => {
    $("draft-length").disabled = $("draft").value !== "fixed";
  });
  const output = $("output");
  output.addEventListener("keydown", onOutputKey);
  output.addEventListener("mouseover", onOutputPointer);
  output.addEventListener("click", (event) => {
    const span = event.target.closest ? event.target.closest(".tok") : null;
    if (span && span.dataset.index !== undefined) inspect(Number(span.dataset.index));
  });
  setState("idle");
  connect();
}

document.addEventListener("DOMContentLoaded", init);
