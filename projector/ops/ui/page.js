// The charts of seqstate's report and live page, drawn with uPlot from a list of points
// (projector/ops/ui/sample.py says what a point holds). The report carries its points in the
// page; the live page starts empty and asks /ui/data for one point a second. After each draw,
// every chart's element carries data-points: the values it drew (0: nothing to draw yet).
(function () {
  "use strict";
  const cfg = JSON.parse(document.getElementById("seqstate-data").textContent);
  const points = cfg.points || [];
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const charts = {};
  // A point is the state at its time, held until the next point changes it: steps, not slopes
  // (across an idle hour, a line would slope where the state stood still).
  // A rate (events/s, a capture rate) is of the interval that ends at its point: it steps
  // back over that interval.
  const held = uPlot.paths.stepped({ align: 1 });
  const over = uPlot.paths.stepped({ align: -1 });

  // The union of keys over the points, at most `most`, those with the largest peak first.
  function keysOf(field, most, valueOf) {
    const peak = new Map();
    for (const p of points) {
      const rows = p[field] || {};
      for (const k in rows) peak.set(k, Math.max(peak.has(k) ? peak.get(k) : -1, valueOf(rows[k])));
    }
    return [...peak.entries()].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1))
      .slice(0, most).map((e) => e[0]).sort();
  }

  function perKey(field, keys, value) {
    return keys.map((k) => points.map((p, i) => value(p, i, k)));
  }

  function diff(i, get) {  // the change of get(point) from the point before, or null
    if (i === 0) return null;
    const a = get(points[i - 1]), b = get(points[i]);
    return a == null || b == null ? null : b - a;
  }

  function series() {
    const t = points.map((p) => p.t);
    const out = {};
    const workers = keysOf("workers", cfg.max_workers, (v) => v[0]);
    const load = (j) => (p, i, k) => (p.workers[k] ? p.workers[k][j] : null);
    out.blocks = { names: workers, data: [t, ...perKey("workers", workers, load(0))] };
    out.prefill = { names: workers, data: [t, ...perKey("workers", workers, load(1))] };
    out.rate = { interval: true, names: ["events/s"], data: [t, points.map((p, i) => {
      const n = diff(i, (q) => q.events), dt = diff(i, (q) => q.t);
      return n == null || !dt ? null : Math.round((n / dt) * 10) / 10;
    })] };
    const hasHoles = points.some((p) => p.holes != null);
    out.faults = { names: hasHoles ? ["dead letters", "Dynamo messages lost"] : ["dead letters"],
      data: [t, points.map((p) => p.dead), ...(hasHoles ? [points.map((p) => p.holes)] : [])] };
    if (points.some((p) => p.age != null)) {
      out.oldest = { names: ["oldest request in flight (s)"], data: [t, points.map((p) =>
        p.age == null ? null : p.age)] };
    }
    const publishers = keysOf("publishers", cfg.max_publishers, (v) => v[0]);
    if (publishers.length) {
      out.capture = { interval: true, names: publishers.map((k) => "publisher " + k), data: [t,
        ...perKey("publishers", publishers, (p, i, k) => {
          const sent = diff(i, (q) => (q.publishers[k] ? q.publishers[k][0] : null));
          const lost = diff(i, (q) => (q.publishers[k] ? q.publishers[k][1] : null));
          return sent ? Math.round(((sent - lost) / sent) * 1000) / 10 : null;
        })] };
    }
    return out;
  }

  function draw(id, s) {
    const box = document.getElementById(id);
    const plot = box.querySelector(".plot");
    const note = box.querySelector(".note");
    if (!s) {
      box.dataset.points = "none";
      note.textContent = box.dataset.none;
      return;
    }
    note.textContent = "";
    const key = JSON.stringify(s.names);
    let chart = charts[id];
    if (chart && chart.key !== key) {
      chart.u.destroy();
      chart = null;
    }
    if (!chart) {
      const opts = {
        width: Math.max(300, plot.clientWidth || 900), height: 220,
        scales: { x: { time: true } },
        axes: [{}, { size: 80 }],
        series: [{}, ...s.names.map((name, i) => ({ label: name, stroke: COLORS[i % COLORS.length],
          width: 1.5, paths: s.interval ? over : held, points: { show: false } }))],
        legend: { show: s.names.length <= 12 },
      };
      chart = charts[id] = { key: key, u: new uPlot(opts, s.data, plot) };
    } else {
      chart.u.setData(s.data);
    }
    let drawn = 0;
    for (const ys of s.data.slice(1)) for (const y of ys) if (y != null) drawn += 1;
    box.dataset.points = String(drawn);
  }

  function table(p) {
    const body = document.querySelector("#oldest-table tbody");
    if (!body) return;
    body.textContent = "";
    for (const [id, age, rank] of (p && p.oldest) || []) {
      const tr = document.createElement("tr");
      for (const text of [id, rank, age.toFixed(1)]) {
        const td = document.createElement("td");
        td.textContent = text;
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
  }

  function render() {
    const s = series();
    for (const id of ["blocks", "prefill", "rate", "faults", "oldest", "capture"]) draw(id, s[id]);
    table(points[points.length - 1]);
    document.body.dataset.drawn = String(points.length);
  }

  async function poll() {
    const status = document.getElementById("status");
    try {
      const answer = await fetch(cfg.data_url, { cache: "no-store" });
      if (!answer.ok) throw new Error(answer.status + " " + (await answer.text()));
      const p = await answer.json();
      if (!points.length || p.t > points[points.length - 1].t) points.push(p);
      if (points.length > cfg.max_points) points.splice(0, points.length - cfg.max_points);
      status.textContent = "live, " + points.length + " points, updated " +
        new Date(p.t * 1000).toISOString().slice(11, 19) + " UTC";
      render();
    } catch (err) {
      status.textContent = "not updated: " + err.message;
    }
  }

  render();
  if (cfg.data_url) {
    poll();
    setInterval(poll, 1000);
  }
})();
