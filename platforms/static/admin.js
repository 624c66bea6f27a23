// Switchboard operator console: polls the admin API about once a second and updates the page in
// place (rows keyed by session, so a Stop button survives refreshes). Text goes in via textContent.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  const STATE_ORDER = { running: 0, queued: 1, idle: 2 };
  const KNOWN_STATS = new Set(["agent_cache", "stop_latency_buckets", "health", "agent"]);
  const rows = new Map();  // session key -> {tr, cells, btn, stopping}
  let timer = null;

  class Unauthorized extends Error {}

  async function api(path, init) {
    const r = await fetch(path, { cache: "no-store", credentials: "same-origin", ...init });
    if (r.status === 401) throw new Unauthorized();
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function live(state, text) {
    $("live").dataset.state = state;
    $("live").textContent = text;
  }

  let toastTimer = null;
  function toast(text) {
    const t = $("toast");
    t.textContent = text;
    t.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { t.hidden = true; }, 3000);
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    if (seconds < 60) return `${seconds.toFixed(1)} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} m ${String(Math.floor(seconds % 60)).padStart(2, "0")} s`;
    return `${Math.floor(seconds / 3600)} h ${String(Math.floor((seconds % 3600) / 60)).padStart(2, "0")} m`;
  }

  /** A chat id short enough to scan; web chat ids are session cookies, not for display. */
  function chatLabel(row) {
    const chat = row.chat || "";
    return chat.length > 14 ? chat.slice(0, 8) + "…" : chat;
  }

  /* --- sessions table --- */

  function makeRow(key) {
    const tr = el("tr");
    tr.dataset.key = key;
    const names = ["platform", "chat", "state", "age", "queued", "tokens", "worker", "why", "action"];
    const cells = {};
    for (const n of names) {
      cells[n] = el("td", n === "age" || n === "queued" || n === "tokens" ? `${n} num` : n);
      tr.appendChild(cells[n]);
    }
    const btn = el("button", "stop-btn", "Stop");
    btn.type = "button";
    btn.title = "Stop this session's turn (the user is told: stopped by operator)";
    cells.action.appendChild(btn);
    const row = { tr, cells, btn, stopping: 0, state: "idle" };
    btn.addEventListener("click", () => stopSession(key, row));
    return row;
  }

  async function stopSession(key, row) {
    row.stopping = Date.now();
    row.btn.disabled = true;
    const label = `${row.cells.platform.textContent} ${row.cells.chat.textContent}`;
    try {
      const r = await api("/admin/api/sessions/stop", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ key }),
      });
      toast(r.stopped ? `Stopped ${label}` : `Nothing was running in ${label}`);
    } catch (e) {
      toast(e instanceof Unauthorized ? "Signed out: sign in again." : `Could not stop ${label}: ${e.message}`);
    }
    refreshNow();
  }

  function renderSessions(list) {
    list.sort((a, b) => (STATE_ORDER[a.state] - STATE_ORDER[b.state])
      || ((b.turn_age_s || 0) - (a.turn_age_s || 0)) || a.key.localeCompare(b.key));
    const body = $("sessions").tBodies[0];
    const seen = new Set();
    let running = 0, queued = 0;
    list.forEach((s, i) => {
      seen.add(s.key);
      let row = rows.get(s.key);
      if (!row) { row = makeRow(s.key); rows.set(s.key, row); }
      const c = row.cells;
      c.platform.textContent = s.platform;
      c.chat.textContent = chatLabel(s);
      c.chat.title = `${s.chat_type} chat`;
      c.state.replaceChildren(el("span", "pill", s.state));
      c.state.firstChild.dataset.state = s.state;
      c.age.textContent = s.state === "running" ? age(s.turn_age_s) : "—";
      c.queued.textContent = String(s.queued);
      c.tokens.textContent = s.tokens ? (s.tokens.prompt + s.tokens.completion).toLocaleString() : "—";
      c.tokens.title = s.tokens ? `prompt ${s.tokens.prompt}, completion ${s.tokens.completion}; `
        + `last request ${s.tokens.context} tokens of context` : "";
      c.worker.textContent = s.worker || "—";
      c.why.replaceChildren();
      const last = s.last_interruption;
      if (last) {
        c.why.append(el("span", "kind", last.kind), last.reason,
          el("span", "ago", `${age(Date.now() / 1000 - last.at)} ago`));
      } else {
        c.why.textContent = "—";
      }
      const active = s.state === "running" || s.state === "queued";
      if (row.stopping && (!active || Date.now() - row.stopping > 3000)) row.stopping = 0;
      row.btn.disabled = !active || Boolean(row.stopping);
      row.tr.dataset.state = s.state;
      running += s.state === "running";
      queued += s.queued;
      if (body.children[i] !== row.tr) body.insertBefore(row.tr, body.children[i] || null);
    });
    for (const [key, row] of rows) {
      if (!seen.has(key)) { row.tr.remove(); rows.delete(key); }
    }
    $("no-sessions").hidden = list.length > 0;
    $("n-running").textContent = String(running);
    $("n-queued").textContent = String(queued);
    $("n-sessions").textContent = String(list.length);
  }

  /* --- figures --- */

  function kv(dl, pairs) {
    dl.replaceChildren();
    for (const [k, v] of pairs) dl.append(el("dt", "", k), el("dd", "", v));
  }

  function renderCache(c) {
    const lookups = c.hits + c.misses;
    $("cache-bar").style.width = `${c.max ? Math.min(100, (100 * c.size) / c.max) : 0}%`;
    kv($("cache"), [
      ["Live agents", `${c.size} / ${c.max}`],
      ["Hit rate", lookups ? `${((100 * c.hits) / lookups).toFixed(1)} %` : "—"],
      ["Hits", String(c.hits)], ["Misses", String(c.misses)], ["Evictions", String(c.evictions)],
    ]);
  }

  function bound(le) {
    if (le === null) return "more";
    return le < 1 ? `${+(le * 1000).toPrecision(3)}ms` : `${le}s`;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /** Bars per bucket (the API gives cumulative counts); p50/p95 as the bucket bound reaching them. */
  function renderHistogram(buckets) {
    const counts = buckets.map(([, cum], i) => cum - (i ? buckets[i - 1][1] : 0));
    const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
    const pct = (q) => {
      const hit = buckets.find(([, cum]) => cum >= q * total);
      return hit ? (hit[0] === null ? "> " + bound(buckets[buckets.length - 2][0]) : "≤ " + bound(hit[0])) : "—";
    };
    $("stop-count").textContent = total
      ? `${total} stop${total === 1 ? "" : "s"} · p50 ${pct(0.5)} · p95 ${pct(0.95)}` : "No stops yet.";
    const W = 440, H = 132, top = 16, base = 106, pad = 16, slot = (W - 2 * pad) / Math.max(counts.length, 1);
    const max = Math.max(1, ...counts);
    const chart = svg("svg", { viewBox: `0 0 ${W} ${H}` });
    chart.appendChild(svg("line", { x1: 0, x2: W, y1: base + 0.5, y2: base + 0.5, class: "axis" }));
    counts.forEach((n, i) => {
      const h = n ? Math.max(2, ((base - top) * n) / max) : 0;
      const x = pad + i * slot + slot * 0.18;
      const rect = svg("rect", { x, y: base - h, width: slot * 0.64, height: h, rx: 2, class: "bar-rect" });
      rect.appendChild(svg("title", {}, `${n} stop${n === 1 ? "" : "s"} ${bound(buckets[i][0])}`));
      chart.appendChild(rect);
      if (n) chart.appendChild(svg("text", { x: pad + i * slot + slot / 2, y: base - h - 3, "text-anchor": "middle",
        class: "count" }, String(n)));
      const last = i === counts.length - 1;
      if (last || (i % 2 === 0 && i !== counts.length - 2)) {  // every other bound, and the overflow
        chart.appendChild(svg("text", { x: pad + i * slot + slot / 2, y: base + 13, "text-anchor": "middle" },
          last ? "> " + bound(buckets[i - 1]?.[0] ?? null) : "≤" + bound(buckets[i][0])));
      }
    });
    chart.appendChild(svg("text", { x: W / 2, y: H - 1, "text-anchor": "middle", class: "caption" },
      "time from a stop to the turn's end"));
    $("histogram").replaceChildren(chart);
  }

  function flatten(prefix, value, out) {
    if (value && typeof value === "object" && !Array.isArray(value)) {
      for (const [k, v] of Object.entries(value)) flatten(prefix ? `${prefix}.${k}` : k, v, out);
    } else {
      out.push([prefix, Array.isArray(value) ? value.join(", ") : String(value)]);
    }
  }

  function renderStats(st) {
    $("agent").textContent = st.agent ? `agent: ${st.agent}` : "";
    renderCache(st.agent_cache);
    renderHistogram(st.stop_latency_buckets || []);
    const health = $("health");
    health.replaceChildren();
    for (const [name, h] of Object.entries(st.health || {})) {
      const advisory = h.required === false;  // shown, not counted against readiness
      const li = el("li", "");
      li.className = h.ok ? "ok" : advisory ? "warn" : "bad";
      li.dataset.name = name;
      li.title = advisory ? "advisory: readiness does not depend on it" : "";
      li.append(el("span", "", name), el("span", "detail", h.ok || advisory ? h.detail : `down: ${h.detail}`));
      health.appendChild(li);
    }
    const extra = [];
    for (const [k, v] of Object.entries(st)) if (!KNOWN_STATS.has(k)) flatten(k, v, extra);
    kv($("extra"), extra.length ? extra : [["Cluster", "off (no leases)"]]);
  }

  /* --- polling and sign-in --- */

  function showLogin() {
    $("console").hidden = true;
    $("login").hidden = false;
    live("locked", "sign in required");
    $("token").focus();
  }

  function showConsole() {
    $("login").hidden = true;
    $("console").hidden = false;
  }

  let busy = false, again = false;

  /** One refresh; never two at once (a Stop asks for one while the timer's may be in flight). */
  async function tick() {
    if (busy) { again = true; return; }
    busy = true;
    clearTimeout(timer);
    timer = null;
    let signedOut = false;
    try {
      const [sessions, stats] = await Promise.all([api("/admin/api/sessions"), api("/admin/api/stats")]);
      showConsole();
      renderSessions(sessions.sessions);
      renderStats(stats);
      live("live", `live · ${new Date().toLocaleTimeString()}`);
    } catch (e) {
      signedOut = e instanceof Unauthorized;
      if (signedOut) showLogin();  // polling resumes after sign-in
      else live("down", "daemon unreachable — retrying");
    } finally {
      busy = false;
    }
    if (signedOut) return;
    if (again) { again = false; tick(); } else timer = setTimeout(tick, 1000);
  }

  const refreshNow = tick;

  $("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const error = $("login-error");
    error.hidden = true;
    let ok = false;
    try {
      const r = await fetch("/admin/login", {
        method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ token: $("token").value }),
      });
      ok = r.ok;
    } catch { /* shown below */ }
    if (!ok) {
      error.textContent = "That token was not accepted.";
      error.hidden = false;
      return;
    }
    $("token").value = "";
    refreshNow();
  });

  tick();
})();
