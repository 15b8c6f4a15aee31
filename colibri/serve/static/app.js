// colibri dashboard: plain JS, Canvas 2D, no dependencies. Feeds: docs/DASHBOARD.md.
"use strict";
const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], abort: null, snap: null, prev: null, series: [],
  atlas: null, atlasView: null, hoverExpert: null };

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = localStorage.getItem("colibri-api-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}
$("apikey").value = localStorage.getItem("colibri-api-key") || "";
$("apikey").addEventListener("change", (e) => { localStorage.setItem("colibri-api-key", e.target.value); start(); });

function fmtBytes(n) {
  const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (Math.abs(n) >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return n.toFixed(n < 10 && i ? 2 : n < 100 && i ? 1 : 0) + " " + u[i];
}

// Server-sent events read with fetch + ReadableStream (EventSource cannot send headers or POST)
async function* sse(resp) {
  const reader = resp.body.getReader(); const dec = new TextDecoder(); let buf = "";
  while (true) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i); buf = buf.slice(i + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

// ---------------------------------------------------------------- chat
function addMsg(role, text) {
  const div = document.createElement("div"); div.className = "msg " + role;
  const body = document.createElement("div"); body.className = "body"; body.textContent = text;
  div.appendChild(body); $("messages").appendChild(div); div.scrollIntoView({ block: "end" });
  return div;
}

async function send(text) {
  if (state.abort) return;
  state.messages.push({ role: "user", content: text });
  addMsg("user", text);
  const div = addMsg("assistant", ""); const body = div.querySelector(".body");
  const msgs = [];
  const sys = $("system").value.trim();
  if (sys) msgs.push({ role: "system", content: sys });
  msgs.push(...state.messages);
  const req = { model: state.model, messages: msgs, stream: true, stream_options: { include_usage: true },
    temperature: parseFloat($("temperature").value), top_p: parseFloat($("top_p").value),
    max_tokens: parseInt($("max_tokens").value, 10) };
  if ($("ignore_eos").checked) req.ignore_eos = true;
  const ctl = new AbortController(); state.abort = ctl;
  $("send").disabled = true; $("stop").disabled = false;
  const t0 = performance.now(); let tFirst = null; let n = 0; let text_ = ""; let usage = null; let finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(req), signal: ctl.signal });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || resp.statusText);
    }
    for await (const data of sse(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices || []) {
        if (c.delta && c.delta.content) {
          if (tFirst === null) tFirst = performance.now();
          n++; text_ += c.delta.content; body.textContent = text_;
          div.scrollIntoView({ block: "end" });
        }
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else { div.classList.add("error"); body.textContent = text_ + (text_ ? "\n" : "") + "error: " + e.message; }
  } finally {
    state.abort = null; $("send").disabled = false; $("stop").disabled = true;
  }
  state.messages.push({ role: "assistant", content: text_ });
  const st = document.createElement("div"); st.className = "stats";
  const wall = (performance.now() - t0) / 1000;
  if (usage && usage.colibri) {
    const c = usage.colibri; const toks = usage.completion_tokens || 0;
    st.textContent = `TTFT ${(c.ttft_seconds * 1000).toFixed(0)} ms · ${c.decode_tokens_per_second.toFixed(1)} tok/s · ` +
      `hit rate ${(c.hit_rate * 100).toFixed(1)}% · ${fmtBytes(toks ? c.bytes_read / toks : 0)} read/token · ` +
      `${usage.prompt_tokens} prompt + ${toks} tokens · ${finish}`;
  } else {
    const ttft = tFirst === null ? "-" : ((tFirst - t0)).toFixed(0) + " ms";
    st.textContent = `${finish || "ended"} · ${n} chunks in ${wall.toFixed(2)} s · TTFT ${ttft} (measured in the browser)`;
  }
  div.appendChild(st);
  loadAtlas();
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault(); const t = $("prompt").value.trim();
  if (!t || state.abort) return; $("prompt").value = ""; send(t);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (state.abort) state.abort.abort(); });
$("clear").addEventListener("click", () => { if (!state.abort) { state.messages = []; $("messages").textContent = ""; } });

// ---------------------------------------------------------------- canvas helpers
function fit(canvas) {
  const r = window.devicePixelRatio || 1; const w = canvas.clientWidth; const h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * r) || canvas.height !== Math.round(h * r)) {
    canvas.width = Math.round(w * r); canvas.height = Math.round(h * r);
  }
  const ctx = canvas.getContext("2d"); ctx.setTransform(r, 0, 0, r, 0, 0);
  return [ctx, w, h];
}
function layerColour(i, n, a) { return `hsla(${Math.round(300 * i / Math.max(1, n - 1))}, 80%, 60%, ${a})`; }

// ---------------------------------------------------------------- heat map
function heatGeometry(s, w) {
  const L = s.moe_layers.length; const E = s.num_experts;
  const left = 34; const cw = Math.max(1, (w - left - 4) / E); const ch = Math.max(2, Math.min(22, 360 / L));
  return { L, E, left, cw, ch, top: 4 };
}
function drawHeat() {
  const s = state.snap; if (!s) return;
  const cv = $("heatmap");
  const g0 = heatGeometry(s, cv.clientWidth);
  cv.style.height = Math.round(g0.ch * g0.L + 8) + "px";
  const [ctx, w] = fit(cv); const g = heatGeometry(s, w);
  ctx.clearRect(0, 0, w, cv.clientHeight);
  const win = s.recent_window * s.top_k;
  ctx.font = "10px sans-serif"; ctx.fillStyle = "#8fa1b3"; ctx.textBaseline = "middle";
  const outline = g.cw >= 5 && g.ch >= 5;
  for (let l = 0; l < g.L; l++) {
    const y = g.top + l * g.ch;
    if (g.ch >= 9) { ctx.fillStyle = "#8fa1b3"; ctx.fillText("L" + s.moe_layers[l], 2, y + g.ch / 2); }
    const rec = s.recent[l]; const st = s.state[l];
    for (let e = 0; e < g.E; e++) {
      const x = g.left + e * g.cw; const v = Math.min(1, rec[e] / Math.max(1, s.recent_window) * 2);
      const tier = st[e];
      ctx.fillStyle = v > 0 ? `hsl(${40 - 40 * v}, 95%, ${18 + 47 * v}%)` : (tier === 2 ? "#2b4260" : "#141820");
      ctx.fillRect(x + 0.5, y + 0.5, Math.max(0.5, g.cw - 1), g.ch - 1);
      if (outline) {
        if (tier === 2) { ctx.strokeStyle = "#e8e8e8"; ctx.lineWidth = 1.5; ctx.setLineDash([]); }
        else if (tier === 1) { ctx.strokeStyle = "#ffb000"; ctx.lineWidth = 2; ctx.setLineDash([3, 2]); }
        else { ctx.strokeStyle = "#2a303a"; ctx.lineWidth = 1; ctx.setLineDash([]); }
        ctx.strokeRect(x + 1.5, y + 1.5, g.cw - 3, g.ch - 3);
      } else if (tier === 1) { ctx.fillStyle = "#ffb000"; ctx.fillRect(x, y, Math.max(1, g.cw), 1); }
    }
  }
  ctx.setLineDash([]);
  $("window").textContent = s.recent_window;
}
$("heatmap").addEventListener("mousemove", (ev) => {
  const s = state.snap; if (!s) return; const cv = $("heatmap");
  const g = heatGeometry(s, cv.clientWidth); const r = cv.getBoundingClientRect();
  const x = ev.clientX - r.left; const y = ev.clientY - r.top;
  const e = Math.floor((x - g.left) / g.cw); const l = Math.floor((y - g.top) / g.ch);
  const tip = $("heattip");
  if (e < 0 || e >= g.E || l < 0 || l >= g.L) { tip.style.display = "none"; return; }
  const gets = s.gets[l][e]; const hits = s.hits[l][e];
  tip.textContent = `layer ${s.moe_layers[l]} expert ${e}\n${["on disk", "being read", "in RAM"][s.state[l][e]]}\n` +
    `recent: ${s.recent[l][e]} of the last ${s.recent_window} tokens\ntokens routed: ${s.tokens[l][e]}\n` +
    `cache gets: ${gets}, hit rate ${gets ? (100 * hits / gets).toFixed(1) + "%" : "-"}`;
  tip.style.display = "block"; tip.style.left = (x + 14) + "px"; tip.style.top = (y + 30) + "px";
});
$("heatmap").addEventListener("mouseleave", () => { $("heattip").style.display = "none"; });

// ---------------------------------------------------------------- where the time goes
function onSnapshot(s) {
  const p = state.snap; state.snap = s;
  if (p) {
    const a = p.statistics, b = s.statistics; const dt = s.time - p.time;
    const dtok = (b.generated_tokens - a.generated_tokens) + (b.prompt_tokens - a.prompt_tokens);
    const dsteps = b.forward_steps - a.forward_steps;
    if (dt > 0) {
      const c = b.compute_seconds - a.compute_seconds, w = b.wait_io_seconds - a.wait_io_seconds;
      // "other": the rest of the interval, counted only when sequences ran through all of it
      // (an interval where a generation starts or ends would count idle time as other)
      const busy = dsteps > 0 ? (a.running > 0 && b.running > 0 ? Math.max(dt, c + w) : c + w) : 0;
      const ntok = Math.max(dtok, dsteps);
      state.series.push({ t: s.time, tokens: ntok, compute: ntok ? 1000 * c / ntok : 0, wait: ntok ? 1000 * w / ntok : 0,
        other: ntok ? 1000 * Math.max(0, busy - c - w) / ntok : 0, gbps: (b.bytes_read - a.bytes_read) / dt / 1e9 });
      if (state.series.length > 240) state.series.shift();
    }
  }
  drawHeat(); drawTime(); gauges();
}
function drawTime() {
  const cv = $("timechart"); const [ctx, w, h] = fit(cv); ctx.clearRect(0, 0, w, h);
  const S = state.series; const n = Math.max(60, S.length); const bw = (w - 40) / n;
  const max = Math.max(1, ...S.map((p) => p.compute + p.wait + p.other)) * 1.1;
  ctx.strokeStyle = "#2c333d"; ctx.fillStyle = "#8fa1b3"; ctx.font = "10px sans-serif";
  for (let k = 0; k <= 4; k++) {
    const y = h - 14 - (h - 20) * k / 4; ctx.beginPath(); ctx.moveTo(36, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText((max * k / 4).toFixed(max < 8 ? 1 : 0), 2, y + 3);
  }
  ctx.fillText("ms/token", 40, 10);
  S.forEach((p, i) => {
    const x = 40 + (n - S.length + i) * bw; let y = h - 14; const sc = (h - 20) / max;
    for (const [v, col] of [[p.compute, "#4fc3f7"], [p.wait, "#ff7043"], [p.other, "#9e9e9e"]]) {
      const hh = v * sc; ctx.fillStyle = col; ctx.fillRect(x, y - hh, Math.max(1, bw - 0.5), hh); y -= hh;
    }
  });
  // disk GB/s as a line on its own scale
  const gmax = Math.max(0.01, ...S.map((p) => p.gbps)) * 1.1;
  ctx.strokeStyle = "#ffee58"; ctx.beginPath();
  S.forEach((p, i) => { const x = 40 + (n - S.length + i + 0.5) * bw; const y = h - 14 - (h - 20) * p.gbps / gmax; i ? ctx.lineTo(x, y) : ctx.moveTo(x, y); });
  ctx.stroke(); ctx.fillStyle = "#ffee58"; ctx.fillText(`disk (max ${gmax.toFixed(2)} GB/s)`, w - 130, 10);
}
function gauges() {
  const s = state.snap; if (!s) return; const st = s.statistics;
  const occ = st.cache_budget_nbytes ? st.cache_used_nbytes / st.cache_budget_nbytes : 0;
  const last = state.series.length ? state.series[state.series.length - 1] : null;
  const recent = state.series.slice(-8).filter((p) => p.tokens > 0);
  const avg = (k) => recent.length ? recent.reduce((a, p) => a + p[k], 0) / recent.length : 0;
  $("gauges").innerHTML = `cache <span class="bar"><span style="width:${(100 * occ).toFixed(1)}%"></span></span> ` +
    `${fmtBytes(st.cache_used_nbytes)} of ${fmtBytes(st.cache_budget_nbytes)} (${(100 * occ).toFixed(0)}%) · ` +
    `disk ${last ? last.gbps.toFixed(3) : "0"} GB/s · compute ${avg("compute").toFixed(1)} / disk wait ${avg("wait").toFixed(1)} / other ${avg("other").toFixed(1)} ms per token · ` +
    `hit rate ${(100 * st.hit_rate).toFixed(1)}% · running ${st.running}, waiting ${st.waiting}, reads in flight ${st.reads_in_flight}`;
  $("summary").textContent = `${s.moe_layers.length} MoE layers × ${s.num_experts} experts, top-${s.top_k} · ` +
    `${st.prompt_tokens} prompt + ${st.generated_tokens} generated tokens · ${fmtBytes(st.bytes_read)} read`;
}

async function feed() {
  while (true) {
    try {
      const resp = await fetch("/v1/experts/stream?interval=0.25", { headers: headers(false) });
      if (!resp.ok) throw new Error(resp.statusText);
      for await (const data of sse(resp)) onSnapshot(JSON.parse(data));
    } catch (e) { /* the server went away: retry */ }
    await new Promise((r) => setTimeout(r, 1000));
  }
}

// ---------------------------------------------------------------- atlas
async function loadAtlas() {
  const resp = await fetch("/v1/experts/atlas", { headers: headers(false) });
  if (!resp.ok) { $("atlasinfo").textContent = "atlas: " + resp.statusText; return; }
  const a = await resp.json(); const p = a.points; const N = p.x.length;
  const xs = new Float32Array(p.x), ys = new Float32Array(p.y);
  const maxTok = Math.max(1, ...p.tokens.slice(0, 200000));
  state.atlas = { a, N, xs, ys, layer: Int32Array.from(p.layer), expert: Int32Array.from(p.expert), tokens: Float64Array.from(p.tokens), maxTok };
  buildGrid(); drawAtlas();
  const layers = new Set(p.layer).size;
  $("atlasinfo").textContent = `${N} experts in ${layers} layers · placed from ${a.routed_tokens} routed token-layers · ${a.method}`;
}
function atlasXY(i, w, h) { const A = state.atlas; return [w / 2 + A.xs[i] * (w / 2 - 8), h / 2 - A.ys[i] * (h / 2 - 8)]; }
function buildGrid() { // a uniform grid over normalised coordinates: hover finds the nearest point in O(1)
  const A = state.atlas; const G = 64; const cells = new Map();
  for (let i = 0; i < A.N; i++) {
    const gx = Math.min(G - 1, Math.floor((A.xs[i] + 1) / 2 * G)), gy = Math.min(G - 1, Math.floor((A.ys[i] + 1) / 2 * G));
    const k = gx * G + gy; if (!cells.has(k)) cells.set(k, []); cells.get(k).push(i);
  }
  A.grid = cells; A.G = G;
}
function drawAtlas() {
  const A = state.atlas; if (!A) return; const cv = $("atlascanvas"); const [ctx, w, h] = fit(cv);
  ctx.clearRect(0, 0, w, h);
  const nl = Math.max(...A.layer) + 1; const r = A.N > 5000 ? 1.5 : A.N > 500 ? 2.5 : 5;
  // batch by layer: one fillStyle change per layer, one path per layer (fluid at 20k points)
  const byLayer = new Map();
  for (let i = 0; i < A.N; i++) { const l = A.layer[i]; if (!byLayer.has(l)) byLayer.set(l, []); byLayer.get(l).push(i); }
  for (const [l, idx] of byLayer) {
    ctx.fillStyle = layerColour(l, nl, 0.8); ctx.beginPath();
    for (const i of idx) {
      const [x, y] = atlasXY(i, w, h); const rr = r * (0.6 + 0.8 * Math.sqrt(A.tokens[i] / A.maxTok));
      ctx.moveTo(x + rr, y); ctx.arc(x, y, rr, 0, 6.2832);
    }
    ctx.fill();
  }
  if (state.hoverExpert !== null) {
    const [x, y] = atlasXY(state.hoverExpert, w, h);
    ctx.strokeStyle = "#fff"; ctx.lineWidth = 2; ctx.beginPath(); ctx.arc(x, y, r + 4, 0, 6.2832); ctx.stroke();
  }
  // legend
  ctx.font = "10px sans-serif";
  for (let l = 0; l < nl; l += Math.max(1, Math.ceil(nl / 12))) {
    ctx.fillStyle = layerColour(l, nl, 1); ctx.fillText("L" + l, 6 + 26 * (l / Math.max(1, Math.ceil(nl / 12))), h - 6);
  }
}
let hoverTimer = null;
$("atlascanvas").addEventListener("mousemove", (ev) => {
  const A = state.atlas; if (!A) return; const cv = $("atlascanvas"); const r = cv.getBoundingClientRect();
  const w = cv.clientWidth, h = cv.clientHeight; const mx = ev.clientX - r.left, my = ev.clientY - r.top;
  const nx = (mx - w / 2) / (w / 2 - 8), ny = -(my - h / 2) / (h / 2 - 8);
  const gx = Math.floor((nx + 1) / 2 * A.G), gy = Math.floor((ny + 1) / 2 * A.G);
  let best = null, bd = 144;
  for (let dx = -1; dx <= 1; dx++) for (let dy = -1; dy <= 1; dy++) {
    for (const i of A.grid.get((gx + dx) * A.G + gy + dy) || []) {
      const [x, y] = atlasXY(i, w, h); const d = (x - mx) ** 2 + (y - my) ** 2; if (d < bd) { bd = d; best = i; }
    }
  }
  const tip = $("atlastip");
  if (best === null) { tip.style.display = "none"; if (state.hoverExpert !== null) { state.hoverExpert = null; drawAtlas(); } return; }
  if (best !== state.hoverExpert) {
    state.hoverExpert = best; drawAtlas();
    const l = A.layer[best], e = A.expert[best];
    tip.textContent = `layer ${l} expert ${e}\ntokens routed: ${A.tokens[best]}`;
    clearTimeout(hoverTimer);
    hoverTimer = setTimeout(async () => {
      const resp = await fetch(`/v1/experts/${l}/${e}`, { headers: headers(false) });
      if (!resp.ok || state.hoverExpert !== best) return;
      const d = await resp.json();
      const top = d.top_tokens.map((t) => `${JSON.stringify(t.text)} ×${t.count}`).join("\n  ");
      tip.textContent = `layer ${l} expert ${e}\ntokens routed: ${d.tokens}\nhit rate: ${d.hit_rate === null ? "-" : (100 * d.hit_rate).toFixed(1) + "%"}\n` +
        `most routed tokens:\n  ${top || "(none recorded)"}`;
    }, 60);
  }
  tip.style.display = "block"; tip.style.left = (mx + 14) + "px"; tip.style.top = (my + 36) + "px";
});
$("atlascanvas").addEventListener("mouseleave", () => { $("atlastip").style.display = "none"; state.hoverExpert = null; drawAtlas(); });
$("atlasrefresh").addEventListener("click", loadAtlas);
window.addEventListener("resize", () => { drawHeat(); drawTime(); drawAtlas(); });

// ---------------------------------------------------------------- start
let started = false;
async function start() {
  try {
    const resp = await fetch("/v1/models", { headers: headers(false) });
    const m = await resp.json();
    if (!resp.ok) { $("model").textContent = m.error ? m.error.message : resp.statusText; return; }
    state.model = m.data[0].id; $("model").textContent = state.model + " · " + m.data[0].model_type;
  } catch (e) { $("model").textContent = "server unreachable"; return; }
  if (!started) { started = true; feed(); setInterval(() => { if (state.abort) loadAtlas(); }, 3000); }
  loadAtlas();
}
start();
