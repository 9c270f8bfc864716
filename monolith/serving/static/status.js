// The status tab: /metrics (Prometheus text, monolith/serving/metrics.py) read every
// 2 seconds, and four plots drawn as SVG: tok/s, mean acceptance length, queue depth,
// prompt-cache bytes.

import { getJSON, getText } from "./api.js";

const POLL_MS = 2000;
const KEEP = 150; // points a plot keeps (5 minutes)
const SVG = "http://www.w3.org/2000/svg";
const W = 400, H = 120;

// {name or name{labels}: value}
export function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const cut = line.lastIndexOf(" ");
    values[line.slice(0, cut)] = Number(line.slice(cut + 1));
  }
  return values;
}

const CHARTS = [
  { id: "tok-s", title: "tokens/s generated", series: ["tok/s"] },
  { id: "acceptance", title: "mean acceptance length", series: ["tokens/round"] },
  { id: "queue", title: "queue depth", series: ["waiting", "running"] },
  { id: "cache", title: "prompt-cache bytes", series: ["bytes"] },
];

// One sample's plotted values from two scrapes (`before` may be null)
function sample(now, before, seconds) {
  const delta = (name) => (before ? (now[name] || 0) - (before[name] || 0) : 0);
  const drafts = now.spec_decode_num_drafts_total || 0;
  const accepted = now.spec_decode_num_accepted_tokens_total || 0;
  return {
    "tok-s": [before && seconds > 0 ? delta("monolith_generation_tokens_total") / seconds : 0],
    acceptance: [drafts ? (accepted + drafts) / drafts : 0],
    queue: [now.monolith_num_requests_waiting || 0, now.monolith_num_requests_running || 0],
    cache: [now.monolith_prompt_cache_bytes || 0],
  };
}

function svgElement(tag, attributes) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attributes)) el.setAttribute(k, v);
  return el;
}

function formatted(value) {
  if (value >= 1e9) return `${(value / 1e9).toFixed(2)} G`;
  if (value >= 1e6) return `${(value / 1e6).toFixed(2)} M`;
  if (value >= 1e3) return `${(value / 1e3).toFixed(1)} k`;
  return Number.isInteger(value) ? String(value) : value.toFixed(2);
}

const FIRST_SPAN = 30; // points the x axis spans until more have come (a minute)

function draw(chart, points) {
  const highest = Math.max(0, ...points.flat());
  const top = highest || 1;
  const span = Math.max(FIRST_SPAN, points.length) - 1;
  const svg = svgElement("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
  chart.series.forEach((name, s) => {
    const coords = points.map((p, i) => `${((i / span) * W).toFixed(1)},${(H - 4 - (p[s] / top) * (H - 20)).toFixed(1)}`);
    svg.append(svgElement("polyline", { class: `series-${s}`, points: coords.join(" ") }));
  });
  const label = svgElement("text", { x: 4, y: 11, class: "axis" });
  label.textContent = `max ${formatted(highest)}`;
  svg.append(label);
  const last = points[points.length - 1] || [];
  chart.el.querySelector(".now").textContent = chart.series.map((n, s) => `${n} ${formatted(last[s] ?? 0)}`).join(", ");
  chart.el.querySelector("svg").replaceWith(svg);
}

function chartElements(container) {
  return CHARTS.map((chart) => {
    const el = document.createElement("div");
    el.className = "chart";
    el.id = `chart-${chart.id}`;
    const title = document.createElement("h3");
    title.textContent = chart.title;
    const now = document.createElement("span");
    now.className = "now";
    title.append(now);
    el.append(title, svgElement("svg", { viewBox: `0 0 ${W} ${H}` }));
    container.append(el);
    return { ...chart, el, points: [] };
  });
}

// Starts polling; the plots draw into `container`, first with the last minutes the
// server kept (/metrics/history, monolith/serving/metrics.py)
export async function startStatus(container) {
  const charts = chartElements(container);
  let before = null, beforeAt = 0;
  function add(now, at) {
    const values = sample(now, before, (at - beforeAt) / 1000);
    before = now;
    beforeAt = at;
    for (const chart of charts) {
      chart.points.push(values[chart.id]);
      if (chart.points.length > KEEP) chart.points.shift();
    }
  }
  const redraw = () => { for (const chart of charts) draw(chart, chart.points); };
  try {
    const history = await getJSON("/metrics/history");
    const opened = performance.now();
    for (const s of history.samples) add(s.values, opened - s.seconds_ago * 1000);
    redraw();
  } catch (e) {
    console.warn("the server kept no history (/metrics/history)", e);
  }
  async function poll() {
    try {
      add(parseMetrics(await getText("/metrics")), performance.now());
      redraw();
    } catch (e) {
      console.warn("reading /metrics failed", e);
    }
  }
  poll();
  return setInterval(poll, POLL_MS);
}
