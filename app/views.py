"""What the web UI draws: charts of the cache over the conversation, and the conversation as the cache holds it.

Everything here reads a session through its locked read methods (``core/engine/reading.py``) and the store; nothing
changes them.
"""

from __future__ import annotations

import html
import threading
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..core.engine.session import Session, memory_mb
from ..policies import POLICIES
from ..storage.db import Store

VIEW_TOKENS = 30000  # the cache view shows at most this many of the most recent tokens
CHART_POINTS = 300  # the charts draw at most this many points per stored series (``charts``)
TURN_AXES = ((1, 1), (1, 2), (1, 3), (2, 1), (2, 2))  # the charts (row, column) whose x axis is the turn
SHOWN_MESSAGES = 100  # the chat pane shows at most this many of the most recent messages (``chat_messages``)
MB = 2**20


@dataclass
class Live:
    """The turn being generated, drawn as the newest point while a reply streams."""

    turn: int
    cache_tokens: int
    cache_bytes: int
    tokens_per_s: float | None
    rss_mb: float


def error_html(text: str) -> str:
    """A status line shown as an error (in red, with a sign)."""
    return f'<span class="kv-error">⚠ {text}</span>'


def _change_label(changes: dict) -> str:
    shown = [f"{k} {v}" for k, v in changes.items() if k in ("policy", "budget", "groups", "positions", "window",
                                                            "sink")]
    if "params" in changes and changes["params"]:
        shown.append(", ".join(f"{k} {v}" for k, v in changes["params"].items()))
    return " · ".join(shown) or "settings"


def _bounded(policy: str) -> bool:
    """Whether a stored turn's policy evicts (a policy this version does not know counts as bounded)."""
    cls = POLICIES.get(policy)
    return cls is None or cls.bounded


class StoredTurns:
    """A tab's copy of its conversation's stored turn statistics, for the charts: read whole once, then only the
    rows committed since. A chat of days holds thousands of turns (reading 5,000 took 77-158 ms here, twice a
    reply); the copy is read whole again when the tab's conversation changes or turns were taken back (an undo or
    retry leaves fewer of the rows read in the store)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.conversation_id: int | None = None
        self.rows: list[dict] = []

    def read(self, store: Store, conversation_id: int) -> list[dict]:
        with self._lock:
            last = max((r["id"] for r in self.rows), default=0)
            if conversation_id == self.conversation_id and store.turn_stats_count(conversation_id, last) == len(
                    self.rows):
                # a new list: the one handed out before (to the charts drawn while a reply streams) stays as it was
                self.rows = self.rows + store.turn_stats(conversation_id, after_id=last)
            else:
                self.conversation_id, self.rows = conversation_id, store.turn_stats(conversation_id)
            return self.rows


def stored_turns(session: Session, store: Store, copy: StoredTurns) -> tuple[list[dict], list[dict]]:
    """What ``charts`` draws from the store: the conversation's turn statistics (through the tab's ``copy``) and
    settings changes (read once for the charts drawn while a reply streams: they change when it commits)."""
    if session.conversation_id is None:
        return [], []
    return copy.read(store, session.conversation_id), store.settings_changes(session.conversation_id)


def charts(session: Session, stored: tuple[list[dict], list[dict]], rss: dict[int, float], per_position: int,
           live: Live | None = None):
    """The cache over the conversation (``stored``: ``stored_turns``): tokens and bytes against the budget, what
    the stored conversation keeps on disk (recall's archive among it), evictions, decode speed, memory (the GPU's
    allocated on CUDA, else the process's RSS), per-layer budgets; a dashed marker where settings changed."""
    rows, changes = stored
    rows = [r for r in rows if r["role"] != "system"]
    turns = [r["turn"] for r in rows]
    budgets = [r["settings"]["budget"] if _bounded(r["policy"]) else None for r in rows]
    caps = [r["settings"]["budget"] + r["settings"]["slack"] if _bounded(r["policy"]) else None for r in rows]
    tokens = [r["cache_tokens"] for r in rows]
    mbytes = [r["cache_bytes"] / MB for r in rows]
    disk = [r["disk_bytes"] / MB if r.get("disk_bytes") is not None else None for r in rows]
    archive = [(r.get("archive_bytes") or 0) / MB for r in rows]
    speed = [1000 / r["decode_ms_per_token"] if r["decode_ms_per_token"] else None for r in rows]
    evicted = [r["evicted_tokens"] for r in rows]
    recalled = [r.get("recalled_tokens") or 0 for r in rows]
    rss_turns = [t for t in turns if t in rss]
    rss_vals = [rss[t] for t in rss_turns]
    # A point per turn up to CHART_POINTS turns, then a point per k turns: sizes and bounds their largest,
    # speed and tokens per turn their mean (the charts are drawn again every few seconds while a reply streams)
    k = max(1, -(-len(rows) // CHART_POINTS))
    points = [r["turn"] for r in rows][k - 1::k] + ([rows[-1]["turn"]] if len(rows) % k else [])
    tokens, mbytes, disk, archive, budgets, caps = (_every(v, k, max) for v in (tokens, mbytes, disk, archive,
                                                                                  budgets, caps))
    speed, evicted, recalled = (_every(v, k, _mean) for v in (speed, evicted, recalled))
    turns = points
    if live is not None:
        turns, tokens, mbytes = turns + [live.turn], tokens + [live.cache_tokens], mbytes + [live.cache_bytes / MB]
        speed = speed + [live.tokens_per_s]
        settings = session.settings
        budgets = budgets + [settings.budget if settings.bounded else None]
        caps = caps + [settings.capacity if settings.bounded else None]
        rss_turns, rss_vals = rss_turns + [live.turn], rss_vals + [live.rss_mb]

    fig = make_subplots(rows=2, cols=3, horizontal_spacing=0.07, vertical_spacing=0.16, subplot_titles=(
        "cache (positions per layer)", "cache memory and disk (MB)", "evicted / recalled tokens per turn",
        "decode speed (tokens/s)", memory_mb(session.model.device)[0], "positions held per layer now"))
    line = dict(mode="lines+markers", marker=dict(size=5))
    fig.add_trace(go.Scatter(x=turns, y=tokens, name="cache", line=dict(color="#1f77b4"), **line), 1, 1)
    fig.add_trace(go.Scatter(x=turns, y=budgets, name="budget", mode="lines+markers", marker=dict(size=3),
                             line=dict(color="#d62728", dash="dash", shape="hv")), 1, 1)
    fig.add_trace(go.Scatter(x=turns, y=caps, name="budget + slack", mode="lines+markers", marker=dict(size=3),
                             line=dict(color="#ff9896", dash="dot", shape="hv")), 1, 1)
    fig.add_trace(go.Scatter(x=turns, y=mbytes, name="cache MB", line=dict(color="#1f77b4"), showlegend=False,
                             **line), 1, 2)
    fig.add_trace(go.Scatter(x=turns, y=[c * per_position / MB if c else None for c in caps], name="budget MB",
                             mode="lines+markers", marker=dict(size=3),
                             line=dict(color="#ff9896", dash="dot", shape="hv"), showlegend=False),
                  1, 2)
    if any(d is not None for d in disk):  # what the stored conversation keeps beside the database, recall's included
        fig.add_trace(go.Scatter(x=points, y=disk, name="on disk MB", mode="lines",
                                 line=dict(color="#8c564b", dash="dash"), showlegend=False), 1, 2)
    if any(archive):
        fig.add_trace(go.Scatter(x=points, y=archive, name="recall archive MB", mode="lines",
                                 line=dict(color="#2ca02c", dash="dot"), showlegend=False), 1, 2)
    fig.add_trace(go.Bar(x=points, y=evicted, name="evicted", marker_color="#7f7f7f",
                         showlegend=False), 1, 3)
    if any(recalled):
        fig.add_trace(go.Bar(x=points, y=recalled, name="recalled", marker_color="#2ca02c",
                             showlegend=False), 1, 3)
    fig.add_trace(go.Scatter(x=turns, y=speed, name="tokens/s", line=dict(color="#2ca02c"), showlegend=False,
                             **line), 2, 1)
    fig.add_trace(go.Scatter(x=rss_turns, y=rss_vals, name="RSS", line=dict(color="#9467bd"), showlegend=False,
                             **line), 2, 2)
    held, allocated = layer_lengths(session)
    layers = list(range(len(held)))
    fig.add_trace(go.Bar(x=layers, y=held, name="held", marker_color="#1f77b4", showlegend=False), 2, 3)
    if allocated is not None:
        fig.add_trace(go.Scatter(x=layers, y=allocated, name="layer budget", mode="markers",
                                 marker=dict(color="#d62728", symbol="line-ew-open", size=12, line=dict(width=2)),
                                 showlegend=False), 2, 3)
    now = session.cache_now()
    changed = rows and (now["cache_tokens"], now["cache_bytes"]) != (rows[-1]["cache_tokens"], rows[-1]["cache_bytes"])
    if live is None and changed:
        # The cache changed since the last turn (a live settings change compressed it): show where it is now.
        star = dict(mode="markers", marker=dict(symbol="star", size=11, color="#ff7f0e"))
        fig.add_trace(go.Scatter(x=[now["turn"] - 0.5], y=[now["cache_tokens"]], name="now", **star), 1, 1)
        fig.add_trace(go.Scatter(x=[now["turn"] - 0.5], y=[now["cache_bytes"] / MB], name="now MB",
                                 showlegend=False, **star), 1, 2)
    by_turn: dict[int, list[str]] = {}
    for change in changes:
        by_turn.setdefault(change["turn"], []).append(_change_label(change["changes"]))
    # The turn axes span the turns drawn, fixed: plotly widened them to fit a settings change's label, which pushed
    # the data into the left half of the first chart; a label in the right half now reads leftwards
    xs = turns + rss_turns + [now["turn"] - 0.5] + [t - 0.5 for t in by_turn]
    lo, hi = min(xs) - 0.5, max(xs) + 0.5
    for i, (turn, labels) in enumerate(sorted(by_turn.items())):
        x = turn - 0.5
        for r, c in TURN_AXES:
            fig.add_vline(x=x, line=dict(color="#ff7f0e", dash="dash", width=1), row=r, col=c)
        side = "left" if x < (lo + hi) / 2 else "right"
        fig.add_annotation(x=x, y=1 - 0.12 * (i % 3), yref="y domain", text="<br>".join(labels), showarrow=False,
                           xanchor=side, yanchor="top", align=side, font=dict(size=10, color="#ff7f0e"), row=1, col=1)
    for r, c in TURN_AXES:
        fig.update_xaxes(range=[lo, hi], row=r, col=c)
    fig.update_xaxes(title_text="turn" if k == 1 else f"turn (a point per {k} turns)", row=2, col=1)
    fig.update_xaxes(title_text="turn", row=2, col=2)
    fig.update_xaxes(title_text="layer", row=2, col=3)
    fig.update_layout(height=520, margin=dict(l=40, r=10, t=40, b=40), legend=dict(orientation="h", y=-0.12),
                      template="plotly_white", uirevision="kvchat")
    return fig


def _every(values: list, k: int, how) -> list:
    """``values`` (None where a turn has none) a point per ``k`` turns: ``how`` (max, _mean) of each run's."""
    if k == 1:
        return values
    runs = ([v for v in values[i: i + k] if v is not None] for i in range(0, len(values), k))
    return [how(run) if run else None for run in runs]


def _mean(values: list) -> float:
    return sum(values) / len(values)


def layer_lengths(session: Session) -> tuple[list[float], list[float] | None]:
    """Mean positions held per layer now, and the policy's per-layer allocation if it has one."""
    held = session.layer_lengths()
    report = session.policy_report()
    if report.get("layer_budgets"):
        return held, [float(b) for b in report["layer_budgets"]]
    if report.get("head_budgets"):
        return held, [sum(h) / len(h) for h in report["head_budgets"]]
    return held, None


CLASS_COLORS = {"retrieval": "#1f77b4", "induction": "#ff7f0e", "local": "#2ca02c"}


def head_map(session: Session):
    """The head-aware policy's class per layer and KV head (None for other policies or before its first pass)."""
    report = session.policy_report()
    classes = report.get("head_classes")
    if not classes:
        return None
    names = list(CLASS_COLORS)
    z = [[names.index(c) for c in layer] for layer in classes]
    budgets = report.get("head_budgets") or [[None] * len(layer) for layer in classes]
    text = [[f"{c}<br>budget {b}" for c, b in zip(layer, bl)] for layer, bl in zip(classes, budgets)]
    n = len(names)
    scale = []  # one flat colour band per class
    for k, name in enumerate(names):
        scale += [[k / n, CLASS_COLORS[name]], [(k + 1) / n, CLASS_COLORS[name]]]
    fig = go.Figure(go.Heatmap(z=z, text=text, hoverinfo="text+x+y", zmin=-0.5, zmax=n - 0.5,
                               colorscale=scale, colorbar=dict(tickvals=list(range(n)), ticktext=names)))
    fig.update_layout(title="head classes (layer × KV head)", height=420, template="plotly_white",
                      xaxis_title="KV head", yaxis_title="layer", margin=dict(l=40, r=10, t=40, b=40))
    return fig


def cache_view(session: Session) -> str:
    """The conversation as the model sees it: text the cache holds in every head, in some heads, or in none."""
    # the tokens shown, and counts over what the cache holds: a reply in a chat of days costs the view what it shows,
    # not the whole chat (ad hoc, 150,000 tokens, a 2-layer model: 54 ms when it read every token, 27 now)
    rows = session.token_rows(VIEW_TOKENS)
    n, start, seen, full, recalled = rows["total"], rows["start"], rows["seen"], rows["full"], rows["recalled_held"]
    if n == 0:
        return '<div class="kv-cacheview"><p class="kv-summary">Nothing cached yet.</p></div>'
    tokens, message, role = rows["token"], rows["message"], rows["role"]  # from ``start`` on
    # recall brought it back and the cache still holds it: marked apart from what never left
    levels = [3 if r and h > 0 else 2 if h >= 0.9999 else 1 if h > 0 else 0
              for h, r in zip(rows["held"], rows["recalled"])]
    tok = session.model.tokenizer
    parts = [f'<p class="kv-summary">The model still sees <b>{seen:,}</b> of {n:,} tokens ({100 * seen / n:.0f}%)'
             f': {full:,} in every head, {seen - full:,} in some heads, {n - seen:,} evicted'
             + (f"; {recalled:,} of them recalled." if recalled else ".")
             + (f" Showing the last {VIEW_TOKENS:,}." if start else "") + "</p>"]
    cls = {3: "kv-recalled", 2: "kv-kept", 1: "kv-partial", 0: "kv-evicted"}
    # the template's own special tokens, drawn apart from the same characters typed in a message
    mark = [t in session.model.chat.special_ids for t in tokens]
    i, open_msg, shown = 0, None, len(tokens)
    while i < shown:
        if message[i] != open_msg:
            if open_msg is not None:
                parts.append("</div>")
            open_msg = message[i]
            r = role[i]
            parts.append(f'<div class="kv-msg kv-{r}"><span class="kv-role">{r}</span>')
        j = i
        while j < shown and message[j] == open_msg and levels[j] == levels[i] and mark[j] == mark[i]:
            j += 1
        text = tok.decode(tokens[i:j], skip_special_tokens=False)
        title = ' title="recalled from the archive"' if levels[i] == 3 else ""
        kind = cls[levels[i]] + (" kv-mark" if mark[i] else "")
        title = title or (' title="the chat template\'s special token"' if mark[i] else "")
        parts.append(f'<span class="{kind}"{title}>{html.escape(text)}</span>')
        i = j
    parts.append("</div>")
    return '<div class="kv-cacheview">' + "".join(parts) + "</div>"


def message_tokens(session: Session) -> list[int]:
    """Tokens per message (as the template rendered it), by message index."""
    return [m["tokens"] for m in session.read_messages()]


def chat_messages(session: Session, in_progress: bool = True) -> list[dict]:
    """The conversation for the chat pane: its last ``SHOWN_MESSAGES`` messages, each with its token count (system
    prompt left out), after a note of how many earlier ones are not shown. Without ``in_progress``, the reply being
    generated is left out (the caller draws it as it streams).

    The pane is sent and drawn again with every streamed token: a conversation of 6,001 messages took 13 s to open
    in the browser and a reply did not finish in 2 minutes (ad hoc, chromium); every message stays stored, and the
    export has them all."""
    shown = [{"role": m["role"], "content": f"{m['content']}\n\n<sub>{m['tokens']:,} tokens</sub>"}
             for m in session.read_messages(in_progress=in_progress) if m["role"] != "system"]
    if len(shown) <= SHOWN_MESSAGES:
        return shown
    earlier = len(shown) - SHOWN_MESSAGES
    note = {"role": "assistant", "content": f"The last {SHOWN_MESSAGES} messages are shown here; the {earlier:,} "
            "before them are stored with the conversation (Export saves them all).",
            "metadata": {"title": f"{earlier:,} earlier messages"}}
    return [note] + shown[-SHOWN_MESSAGES:]
