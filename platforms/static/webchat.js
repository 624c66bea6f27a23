// Switchboard web chat: one websocket, the view rebuilt from the server's history on every
// (re)connect, unacknowledged messages resent with their client id (the router drops repeats).
// Model text is rendered as Markdown by building DOM nodes with textContent: never innerHTML.
"use strict";

/* ---------- safe Markdown ---------------------------------------------------------------- */

const SB_MD = (() => {
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  // One alternative per inline construct; the earliest match wins, text between is plain text.
  const INLINE = new RegExp([
    /(?<code>`+)(?<codeText>[^`]|[^`][\s\S]*?[^`])\k<code>(?!`)/,
    /\*\*(?<strong>\S(?:[\s\S]*?\S)?)\*\*/,
    /(?<![\w])__(?<strong2>\S(?:[\s\S]*?\S)?)__(?![\w])/,
    /\*(?<em>[^\s*](?:[\s\S]*?[^\s*])?)\*/,
    /(?<![\w])_(?<em2>[^\s_](?:[\s\S]*?[^\s_])?)_(?![\w])/,
    /~~(?<del>\S(?:[\s\S]*?\S)?)~~/,
    /\[(?<label>[^\[\]\n]+)\]\(\s*<?(?<href>[^\s()<>]*(?:\([^\s()<>]*\)[^\s()<>]*)*)>?\s*\)/,
    /(?<auto>https?:\/\/[^\s<>"'`]*[^\s<>"'`.,;:!?)\]])/,
    /(?<br>\n)/,
    /\\(?<esc>[\\`*_{}\[\]()#+\-.!~>|])/,
  ].map((r) => r.source).join("|"), "g");

  function el(tag, cls) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    return node;
  }

  /** An absolute http(s) URL, or null: no javascript:, data:, relative or other schemes. */
  function safeUrl(raw) {
    try {
      const url = new URL(raw);
      return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
    } catch {
      return null;
    }
  }

  function link(href, parent) {
    const a = el("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    parent.appendChild(a);
    return a;
  }

  function inline(text, parent, inLink) {
    const re = new RegExp(INLINE);  // its own lastIndex: this function recurses
    let at = 0;
    for (let m = re.exec(text); m; m = re.exec(text)) {
      const g = m.groups;
      let node = null;
      if (g.code !== undefined) {
        node = el("code");
        const body = g.codeText;
        node.textContent = /^ .* $/s.test(body) && body.trim() ? body.slice(1, -1) : body;
      } else if (g.strong !== undefined || g.strong2 !== undefined) {
        node = el("strong");
        inline(g.strong ?? g.strong2, node, inLink);
      } else if (g.em !== undefined || g.em2 !== undefined) {
        node = el("em");
        inline(g.em ?? g.em2, node, inLink);
      } else if (g.del !== undefined) {
        node = el("del");
        inline(g.del, node, inLink);
      } else if (g.label !== undefined) {
        const href = inLink ? null : safeUrl(g.href);
        if (href) {
          parent.append(text.slice(at, m.index));
          inline(g.label, link(href, parent), true);
          at = re.lastIndex;
          continue;
        }
      } else if (g.auto !== undefined) {
        let url = g.auto;
        const count = (c) => url.split(c).length - 1;
        while (text[re.lastIndex] === ")" && count("(") > count(")")) {  // wiki-style a_(b), not "(see x)"
          url += ")";
          re.lastIndex++;
        }
        const href = inLink ? null : safeUrl(url);
        if (href) {
          parent.append(text.slice(at, m.index));
          link(href, parent).textContent = url;
          at = re.lastIndex;
          continue;
        }
      } else if (g.br !== undefined) {
        node = el("br");
      } else if (g.esc !== undefined) {
        parent.append(text.slice(at, m.index), g.esc);
        at = re.lastIndex;
        continue;
      }
      if (node === null) continue;  // not a construct after all (an unsafe link): stays plain text
      parent.append(text.slice(at, m.index));
      parent.appendChild(node);
      at = re.lastIndex;
    }
    parent.append(text.slice(at));
  }

  function codeBlock(code, lang) {
    const box = el("div", "code");
    const head = el("div", "code-head");
    const label = el("span");
    label.textContent = lang || "code";
    const copy = el("button");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => {
      navigator.clipboard?.writeText(code).then(() => {
        copy.textContent = "Copied";
        setTimeout(() => { copy.textContent = "Copy"; }, 1200);
      }, () => {});
    });
    head.append(label, copy);
    const pre = el("pre");
    const c = el("code");
    c.textContent = code;
    pre.appendChild(c);
    box.append(head, pre);
    return box;
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function list(lines, i, parent) {
    const first = ITEM.exec(lines[i]);
    const ordered = /\d/.test(first[2]);
    const indent = first[1].length;
    const node = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    let item = null;
    const flush = () => { if (item) blocks(item.lines, item.li); };
    while (i < lines.length) {
      const line = lines[i];
      const m = ITEM.exec(line);
      if (m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered) {
        flush();
        item = { li: el("li"), lines: [m[3]], pad: m[1].length + m[2].length + 1 };
        node.appendChild(item.li);
        i++;
      } else if (!line.trim()) {
        const next = lines[i + 1];
        if (next === undefined || !(ITEM.test(next) || /^ {2,}\S/.test(next))) break;
        item.lines.push("");
        i++;
      } else if (/^ {2,}\S/.test(line)) {
        item.lines.push(line.replace(new RegExp(`^ {1,${item.pad}}`), ""));
        i++;
      } else if (!startsBlock(line)) {
        item.lines.push(line);  // a lazy continuation of the item's text
        i++;
      } else {
        break;
      }
    }
    flush();
    parent.appendChild(node);
    return i;
  }

  function blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        i++;  // the closing fence; while streaming there may be none yet
        parent.appendChild(codeBlock(body.join("\n"), m[2]));
      } else if (!line.trim()) {
        i++;
      } else if ((m = HEADING.exec(line))) {
        const h = el("h" + Math.min(m[1].length + 2, 6));
        inline(m[2], h, false);
        parent.appendChild(h);
        i++;
      } else if (RULE.test(line)) {
        parent.appendChild(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const inner = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) inner.push(lines[i].replace(QUOTE, ""));
        const q = el("blockquote");
        blocks(inner, q);
        parent.appendChild(q);
      } else if (ITEM.test(line)) {
        i = list(lines, i, parent);
      } else {
        const para = [line];
        for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) para.push(lines[i]);
        const p = el("p");
        const text = para.join("\n");
        if (text.startsWith("⚠️")) p.className = "warn";
        inline(text, p, false);
        parent.appendChild(p);
      }
    }
  }

  /** Render `src` as Markdown into `parent` (replacing what it held). */
  function render(src, parent) {
    parent.replaceChildren();
    blocks(String(src).replace(/\r\n?/g, "\n").split("\n"), parent);
  }

  return { render, safeUrl };
})();

/* ---------- the chat --------------------------------------------------------------------- */

(() => {
  const $ = (id) => document.getElementById(id);
  const scroller = $("scroller"), log = $("log"), empty = $("empty"), input = $("text");
  const stopBtn = $("stop"), newBtn = $("new"), conn = $("conn"), banner = $("banner"), agent = $("agent");
  const sendBtn = $("send"), count = $("count");

  let ws = null;
  let timer = null;
  let connected = false;
  let running = false;
  let attempt = 0;
  let everConnected = false;
  let restarting = false;
  let outbox = [];  // unacknowledged messages: {id, text, parts, index, el}
  let attached = [];  // images and files pasted or dropped, sent with the next message: {name, size, url, image}
  const attachments = $("attachments");
  let userCount = 0;  // user messages in the conversation as shown, for matching the outbox to history
  let maxChars = 0;  // the longest message the gateway takes (from hello); 0: not known yet
  const bots = new Map();  // bot message id -> {el, body}
  const texts = new WeakMap();  // bot message element -> the text it shows
  const dropped = new Set();  // bot ids of an abandoned conversation (New), whose late edits are ignored
  let markedAt = 0;  // when a stop mark was last shown live
  const toolRows = new Map();  // tool call id -> {el, time, stop, result, state, started (ms), elapsed}
  let typing = null;

  const LABELS = {
    "stopped by user (/stop)": "Stopped",
    "stopped by operator": "Stopped by the operator",
    "gateway restart": "Interrupted by a gateway restart",
    "gateway stopped before the turn finished": "Interrupted: the gateway stopped before the answer finished",
    "user sent a new message": "Interrupted by your next message",
    "session reset (/new)": "Interrupted: new conversation",
  };

  function interruptionLabel(i) {
    return LABELS[i.reason] || "Interrupted: " + i.reason;
  }

  function newId() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));  // randomUUID needs a secure context
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function nearBottom() {
    return scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 80;
  }

  function place(node, stick = nearBottom()) {
    if (typing && typing.parentNode === log && node !== typing) log.insertBefore(node, typing);
    else log.appendChild(node);
    empty.hidden = true;
    if (stick) scroller.scrollTop = scroller.scrollHeight;
    return node;
  }

  function clearView() {
    log.replaceChildren();
    bots.clear();
    toolRows.clear();
    typing = null;
    userCount = 0;
    empty.hidden = false;
  }

  function addUser(text, id, pending, at) {
    const node = document.createElement("div");
    node.className = "msg user" + (pending ? " pending" : "");
    node.textContent = text;
    if (id) node.dataset.clientId = id;
    if (at) node.title = new Date(at * 1000).toLocaleString();
    return place(node, true);
  }

  function addNotice(kind, text, mark) {
    const node = document.createElement("div");
    node.className = mark ? "notice mark" : "notice";
    if (text.includes("\n")) node.classList.add("multi");  // /help and the like keep their lines
    node.dataset.kind = kind || "info";
    node.textContent = text;
    return place(node);
  }

  /* --- tool calls: a row each, live (`tool` frames) and from the history alike --- */

  function elapsedText(s) {
    s = Math.max(0, Math.floor(s));
    if (s < 60) return `${s} s`;
    const m = Math.floor(s / 60);
    if (m < 60) return s % 60 ? `${m} min ${s % 60} s` : `${m} min`;
    return `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  const CUT = { stopped: "stopped", restart: "cut off by a restart", interrupted: "interrupted" };

  function toolTime(row) {
    if (row.state === "running") return elapsedText((Date.now() - row.started) / 1000);
    const took = row.elapsed == null ? "" : elapsedText(row.elapsed);
    if (row.state !== "interrupted") return took;
    const cut = CUT[row.cut] || "interrupted";
    return took ? `${cut} after ${took}` : cut;
  }

  function upsertTool(t) {
    let row = toolRows.get(t.id);
    if (!row) {
      const el = document.createElement("div");
      el.className = "tool";
      el.dataset.id = t.id;
      const head = document.createElement("div");
      head.className = "tool-head";
      const icon = document.createElement("span");
      icon.className = "tool-icon";
      icon.setAttribute("aria-hidden", "true");
      const name = document.createElement("span");
      name.className = "tool-name";
      name.textContent = t.name;
      const args = document.createElement("code");
      args.className = "tool-args";
      args.textContent = t.summary || "";
      args.title = t.summary || "";
      const time = document.createElement("span");
      time.className = "tool-time";
      const stop = document.createElement("button");
      stop.type = "button";
      stop.className = "tool-stop";
      stop.textContent = "Stop";
      stop.title = `Stop ${t.name} and the answer it is for`;
      stop.addEventListener("click", () => {
        if (sendFrame({ type: "command", name: "stop" })) { stop.disabled = true; stopBtn.disabled = true; }
      });
      head.append(icon, name, args, time, stop);
      el.append(head);
      row = { el, time, stop, result: null, state: "", started: Date.now(), elapsed: null, cut: "" };
      toolRows.set(t.id, row);
      place(el);
    }
    const stick = nearBottom();
    row.state = t.state;
    row.el.dataset.state = t.state;
    row.elapsed = t.elapsed_s ?? null;
    row.cut = t.interrupted ? t.interrupted.kind : "";
    if (t.state === "running") row.started = Date.now() - (Number(t.elapsed_s) || 0) * 1000;
    row.stop.hidden = t.state !== "running";
    row.stop.disabled = !(connected && running);
    row.time.textContent = toolTime(row);
    if (t.result != null && !row.result) {
      row.result = document.createElement("details");
      row.result.className = "tool-result";
      const summary = document.createElement("summary");
      summary.textContent = "Result";
      const pre = document.createElement("pre");
      pre.textContent = t.result;
      row.result.append(summary, pre);
      row.el.append(row.result);
    }
    if (stick) scroller.scrollTop = scroller.scrollHeight;
    return row;
  }

  setInterval(() => {
    for (const row of toolRows.values()) if (row.state === "running") row.time.textContent = toolTime(row);
  }, 1000);

  function botBubble(id) {
    const node = document.createElement("div");
    node.className = "msg bot";
    const body = document.createElement("div");
    body.className = "body";
    node.appendChild(body);
    if (id) node.dataset.id = id;
    const bot = { el: node, body };
    if (id) bots.set(id, bot);
    place(node);
    return bot;
  }

  function showBot(bot, text, interrupted) {
    const stick = nearBottom();
    texts.set(bot.el, text);
    SB_MD.render(text, bot.body);
    bot.el.querySelector(".interruption")?.remove();
    if (interrupted) {
      const foot = document.createElement("div");
      foot.className = "interruption";
      foot.dataset.kind = interrupted.kind;
      foot.textContent = interruptionLabel(interrupted);
      bot.el.appendChild(foot);
    }
    if (stick) scroller.scrollTop = scroller.scrollHeight;
  }

  function showTyping(on) {
    if (on && !typing) {
      typing = document.createElement("div");
      typing.className = "typing";
      typing.setAttribute("aria-label", "Writing");
      typing.append(document.createElement("span"), document.createElement("span"), document.createElement("span"));
      place(typing);
    } else if (!on && typing) {
      typing.remove();
      typing = null;
    }
  }

  function setRunning(on) {
    running = on;
    document.body.dataset.running = String(on);
    if (!on) showTyping(false);
    buttons();
  }

  function buttons() {
    stopBtn.disabled = !(connected && running);
    newBtn.disabled = !connected;
    for (const row of toolRows.values()) row.stop.disabled = !(connected && running);
  }

  function setConn(state) {
    conn.dataset.state = state;
    conn.textContent = { connected: "connected", connecting: "connecting…", reconnecting: "reconnecting…",
      restarting: "restarting…" }[state];
    const text = state === "restarting" ? "The gateway is restarting — reconnecting…"
      : state === "reconnecting" ? "Connection lost — reconnecting…" : "";
    const stick = nearBottom();  // the banner takes room from the conversation: keep its end in view
    banner.hidden = !text;
    banner.textContent = text;
    banner.dataset.kind = state === "restarting" ? "restart" : "";
    if (stick) scroller.scrollTop = scroller.scrollHeight;
  }

  function sendFrame(frame) {
    if (!connected || !ws) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  /* --- frames from the daemon --- */

  function onHello(f) {
    connected = true;
    everConnected = true;
    restarting = false;
    attempt = 0;
    setConn("connected");
    agent.textContent = f.agent || "";
    maxChars = Number(f.max_chars) || 0;
    updateCount();
    clearView();
    const users = [];
    for (const m of f.history) {
      if (m.role === "user" && m.resume) {
        addNotice("resume", "Continuing the answer after the restart");
      } else if (m.role === "user" && m.job) {
        addNotice("info", m.job);
      } else if (m.role === "user") {
        addUser(m.text, null, false, m.at);
        users.push(m.text);
      } else if (m.role === "assistant") {
        historyReply(m);
      }
    }
    for (const t of f.tools || []) upsertTool(t);  // the running turn's calls, not recorded yet
    userCount = users.length;
    // Messages never acknowledged: drop those the history shows arrived, show and resend the rest.
    const claimed = new Set();
    const keep = [];
    for (const e of outbox) {
      let found = -1;
      for (let i = Math.min(e.index, users.length); i < users.length; i++) {
        if (!claimed.has(i) && sameMessage(users[i], e)) { found = i; break; }
      }
      if (found >= 0) {
        claimed.add(found);
        continue;
      }
      e.index = userCount++;
      e.el = addUser(e.shown, e.id, true);
      keep.push(e);
    }
    outbox = keep;
    for (const e of outbox) sendFrame({ type: "message", id: e.id, text: e.text, parts: e.parts });
    setRunning(Boolean(f.running));
    if (f.running) showTyping(true);
    empty.hidden = log.childElementCount > 0;
    scroller.scrollTop = scroller.scrollHeight;
  }

  function historyReply(m) {
    const failed = !m.interrupted_by && /^\[error: /.test(m.text);
    if (m.text) {
      const bot = botBubble(null);
      if (failed) bot.el.classList.add("error");
      showBot(bot, failed ? "⚠️ The agent failed: " + m.text.slice(8, -1) : m.text, m.interruption);
      for (const call of m.calls || []) upsertTool(call);
      return;
    }
    if (m.calls && m.calls.length) {
      for (const call of m.calls) upsertTool(call);
    } else if (m.tools && m.tools.length) {
      const t = addNotice("info", "Used " + m.tools.join(", "));
      t.classList.add("tools");
    }
    // A stop that cut a tool call short is carried on its row: the mark stays after a reload.
    if (m.interruption) addNotice(m.interruption.kind, interruptionLabel(m.interruption), true);
  }

  /** The history's last answer, if it is the very message `text` belongs to (a frame that raced the
   * hello: its turn ended just as the history was read), so it is updated rather than shown twice. */
  function adopt(id, text) {
    const last = log.lastElementChild === typing ? typing?.previousElementSibling : log.lastElementChild;
    if (!last || !last.classList.contains("bot") || last.dataset.id || texts.get(last) !== text) return null;
    last.dataset.id = id;
    const bot = { el: last, body: last.querySelector(".body") };
    bots.set(id, bot);
    return bot;
  }

  function onBot(f) {
    if (dropped.has(f.id)) return;
    showTyping(false);
    const suffix = "\n\n⏹";
    const body = !f.interrupted ? f.text
      : f.body ?? (f.text.includes(suffix) ? f.text.slice(0, f.text.lastIndexOf(suffix)) : f.text);
    const bot = bots.get(f.id) || adopt(f.id, body) || botBubble(f.id);
    if (f.interrupted) {
      showBot(bot, body, f.interrupted);
      // The mark on the answer says it all: drop the "Stopped." acknowledgement just before it.
      const last = log.lastElementChild;
      if (last && last.matches(".notice[data-kind=stopped]:not(.mark)") && last.textContent === "Stopped.") {
        last.remove();
      }
    } else {
      showBot(bot, f.text, null);
    }
    if (f.text.includes("\n\n⚠️ ") || f.text.startsWith("⚠️ ")) bot.el.classList.add("error");
  }

  function onAck(f) {
    const i = outbox.findIndex((e) => e.id === f.id);
    if (i < 0) return;
    const [e] = outbox.splice(i, 1);
    e.el.classList.remove("pending");
    if (f.outcome === "rejected" || f.outcome === "unavailable" || f.outcome === "command") {  // not part of the conversation
      e.el.classList.add(f.outcome === "command" ? "command" : "rejected");
      userCount--;
      for (const later of outbox) if (later.index > e.index) later.index--;
    }
  }

  function onFrame(f) {
    switch (f.type) {
      case "hello": onHello(f); break;
      case "message": case "edit": onBot(f); break;
      case "ack": onAck(f); break;
      case "state": setRunning(Boolean(f.running)); if (f.running) showTyping(true); break;
      case "typing": if (running) showTyping(true); break;
      case "user":
        if (!outbox.some((e) => e.id === f.id)) { addUser(f.text, f.id, false); userCount++; }
        break;
      case "tool": upsertTool(f); break;
      case "notice":
        if (f.interrupted) {
          const last = log.lastElementChild === typing ? typing?.previousElementSibling : log.lastElementChild;
          if (last && last.matches(".notice[data-kind=stopped]:not(.mark)") && last.textContent === "Stopped.") {
            last.remove();  // the mark says it: one stop notice per stop
          }
          addNotice(f.interrupted.kind, interruptionLabel(f.interrupted), true);
          markedAt = Date.now();
        } else if (!(f.kind === "stopped" && f.text === "Stopped." && Date.now() - markedAt < 3000)) {
          addNotice(f.kind, f.text);  // (a "Stopped." right after a stop mark is that stop, said already)
        }
        break;
      default: break;  // a newer daemon's frame: ignore
    }
  }

  /* --- connection, with backoff --- */

  function schedule() {
    const cap = Math.min(250 * 2 ** attempt, 5000);
    attempt++;
    timer = setTimeout(reconnect, cap / 2 + Math.random() * cap / 2);
  }

  async function reconnect() {
    clearTimeout(timer);
    timer = null;
    if (ws) return;
    // Probe with a plain request first: it renews a lost session cookie and avoids noisy socket errors.
    try {
      const r = await fetch(location.pathname, { cache: "no-store", credentials: "same-origin" });
      if (!r.ok) throw new Error(String(r.status));
    } catch {
      if (!ws && !timer) schedule();
      return;
    }
    if (!ws) connect();
  }

  function connect() {
    const url = new URL("ws", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    const sock = new WebSocket(url.href);
    ws = sock;
    setConn(everConnected ? (restarting ? "restarting" : "reconnecting") : "connecting");
    sock.onmessage = (ev) => {
      if (ws !== sock) return;
      let f;
      try { f = JSON.parse(ev.data); } catch { return; }
      onFrame(f);
    };
    sock.onclose = (ev) => {
      if (ws !== sock) return;
      ws = null;
      connected = false;
      if (ev.code === 1012) restarting = true;
      setRunning(false);
      if (everConnected) setConn(restarting ? "restarting" : "reconnecting");
      schedule();
    };
  }

  /* --- user actions --- */

  /** Characters as the gateway counts them (code points, not UTF-16 units). */
  function length(text) {
    return [...text].length;
  }

  /** The counter shows near and over the limit; an over-limit draft cannot be sent but is kept. */
  function updateCount() {
    const n = length(input.value);
    const over = maxChars > 0 && n > maxChars;
    count.hidden = !(maxChars > 0 && n > maxChars * 0.9);
    count.dataset.over = String(over);
    const shown = `${n.toLocaleString()} / ${maxChars.toLocaleString()}`;
    count.textContent = over ? `${shown} — too long to send` : shown;
    input.setAttribute("aria-invalid", String(over));
    sendBtn.disabled = over;
    return over;
  }

  /** Is a history row (as stored: the text, then a placeholder per attachment) this outbox entry? */
  function sameMessage(row, e) {
    if (!e.parts.length) return row === e.text;
    return row.startsWith(e.text.trim() ? e.text + "\n[" : "[");
  }

  function sizeText(n) {
    if (n < 1024) return `${n} B`;
    if (n < 1048576) return `${Math.round(n / 1024)} KB`;
    return `${(n / 1048576).toFixed(1)} MB`;
  }

  /** Pasted or dropped files wait in the composer as chips (× removes one) until the next send. */
  function showAttached() {
    attachments.replaceChildren();
    attachments.hidden = !attached.length;
    attached.forEach((a, i) => {
      const chip = document.createElement("span");
      chip.className = "chip";
      chip.textContent = `${a.image ? "🖼" : "📄"} ${a.name} · ${sizeText(a.size)}`;
      const drop = document.createElement("button");
      drop.className = "chip-x";
      drop.type = "button";
      drop.textContent = "×";
      drop.title = `Remove ${a.name}`;
      drop.addEventListener("click", () => { attached.splice(i, 1); showAttached(); });
      chip.append(drop);
      attachments.append(chip);
    });
  }

  function attach(files) {
    for (const file of files) {
      const reader = new FileReader();
      reader.onload = () => {
        attached.push({ name: file.name || "pasted.png", size: file.size, url: String(reader.result),
                        image: file.type.startsWith("image/") });
        showAttached();
      };
      reader.readAsDataURL(file);
    }
  }

  function submit() {
    const text = input.value;
    if (!text.trim() && !attached.length) return;
    if (updateCount()) {  // over the limit: the draft stays in the composer, the counter says why
      count.hidden = false;
      return;
    }
    if (/^\s*[/!](new|reset)\s*$/i.test(text)) {  // typed rather than clicked: same thing
      if (newConversation()) { input.value = ""; grow(); updateCount(); }
      return;
    }
    input.value = "";
    grow();
    updateCount();
    // Every attachment goes as a `file` part (its name kept); the gateway decides what it reads.
    const parts = attached.map((a) => ({ type: "file", file: { filename: a.name, file_data: a.url } }));
    const marks = attached.map((a) => `[${a.image ? "image" : "file"}: ${a.name}, ${sizeText(a.size)}]`);
    const shown = [text.trim() ? text : "", ...marks].filter(Boolean).join("\n");
    attached = [];
    showAttached();
    const e = { id: newId(), text, parts, shown, index: userCount++, el: null };
    e.el = addUser(shown, e.id, true);
    outbox.push(e);
    sendFrame({ type: "message", id: e.id, text, parts });
  }

  function grow() {
    input.style.height = "auto";
    input.style.height = Math.min(input.scrollHeight + 2, 192) + "px";
  }

  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); submit(); input.focus(); });
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); submit(); }
  });
  input.addEventListener("input", () => { grow(); updateCount(); });
  input.addEventListener("paste", (ev) => {
    const files = [...(ev.clipboardData ? ev.clipboardData.files : [])];
    if (files.length) { ev.preventDefault(); attach(files); }
  });
  const composer = $("composer");
  composer.addEventListener("dragover", (ev) => { ev.preventDefault(); composer.dataset.drop = "true"; });
  composer.addEventListener("dragleave", () => { delete composer.dataset.drop; });
  composer.addEventListener("drop", (ev) => {
    ev.preventDefault();
    delete composer.dataset.drop;
    if (ev.dataTransfer) attach([...ev.dataTransfer.files]);
  });
  stopBtn.addEventListener("click", () => {
    if (sendFrame({ type: "command", name: "stop" })) stopBtn.disabled = true;
  });
  function newConversation() {
    if (!sendFrame({ type: "command", name: "new" })) return false;
    for (const id of bots.keys()) dropped.add(id);  // the old turn's late edits are not this conversation's
    const pending = outbox;
    clearView();
    setRunning(false);
    for (const e of pending) { e.index = userCount++; e.el = addUser(e.shown, e.id, true); }
    return true;
  }

  newBtn.addEventListener("click", () => { newConversation(); input.focus(); });
  window.addEventListener("online", () => { if (!ws) { attempt = 0; reconnect(); } });

  setConn("connecting");
  connect();
  input.focus();
})();
