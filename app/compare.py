"""``kvchat replay --compare A,B,...``: the same scripts replayed under each policy listed (or ``POLICY:BUDGET``: one
policy at several budgets), with one model load, and what each did side by side: expected answers hit, the probes'
likelihood, the cache's largest size, what it evicted, how many generated replies are the first policy's (list
``full`` first to see how far each policy's chat strays from the full cache's), decode speed and wall time. Nothing
is stored: each run is a new conversation, thrown away after it. A policy that cannot go on with a script (``full``
past the model's positions) says where it stopped and the others run on."""

from __future__ import annotations

import json
import sys

from ..core.engine.session import Session
from ..core.engine.settings import SETTINGS, Settings
from ..policies import POLICIES, policy_class
from .args import CLIError, given_params, given_settings, parse_setting
from .replay import Summary, check_switches, run_step, switched, turn_line


def compared_settings(args) -> list[tuple[str, Settings]]:
    """(label, settings) for each entry ``--compare`` lists: a policy, or ``POLICY:BUDGET`` (one policy at several
    budgets), with the cache flags given and of the policy parameters given those the policy takes. Checked before
    the model loads: CLIError for an unknown policy or budget, an entry listed twice, a parameter none of them takes,
    or a combination one of them cannot run."""
    if args.resume is not None:
        raise CLIError("--compare replays the scripts as new conversations; --resume continues a stored one")
    if args.policy is not None:
        raise CLIError("--compare names the policies; leave out --policy")
    given = given_settings(args)
    entries = []
    for item in filter(None, (item.strip() for item in args.compare.split(","))):
        name, colon, budget = item.partition(":")
        try:
            policy = policy_class(name.strip()).name
            if colon and not POLICIES[policy].bounded:
                raise ValueError(f"{policy} keeps every token: it takes no budget")
            budget = parse_setting(SETTINGS["budget"], budget.strip()) if colon \
                else given.get("budget", SETTINGS["budget"].default)
        except ValueError as exc:
            raise CLIError(f"--compare {item}: {exc}") from None
        entries.append((f"{policy}:{budget}" if colon else policy, policy, budget))
    if len(entries) < 2 or len({(policy, budget) for _, policy, budget in entries}) != len(entries):
        raise CLIError(f"--compare takes two or more different policies (or POLICY:BUDGET), comma-separated, got "
                       f"{args.compare!r}")
    params = given_params(args)
    policies = list(dict.fromkeys(policy for _, policy, _ in entries))
    for name in params:
        if not any(name in {p.name for p in POLICIES[policy].params} for policy in policies):
            raise CLIError(f"--{name.replace('_', '-')} applies to none of {', '.join(policies)}")
    out = []
    for label, policy, budget in entries:
        taken = {p.name for p in POLICIES[policy].params}
        settings = Settings(**{**given, "budget": budget}, policy=policy,
                            params={k: v for k, v in params.items() if k in taken})
        try:
            settings.validate(max_positions=1 << 30)
        except ValueError as exc:
            raise CLIError(f"--compare {label}: {exc}") from None
        out.append((label, settings))
    return out


def run(args, scripts, compared: list[tuple[str, Settings]], sampling, model) -> int:
    """Replay every script under each (label, settings) in turn; per-turn lines with ``--json``, then the
    comparison."""
    from tqdm import tqdm

    for label, settings in compared:
        try:
            settings.validate(model.max_positions, model.rotary_error)
            for script in scripts:
                check_switches(script, settings, model.max_positions, model.rotary_error, compared=True)
        except ValueError as exc:
            raise CLIError(f"--compare {label}: {exc}") from None
    rows, answers = [], []
    bar = tqdm(total=len(compared) * sum(step.turn for s in scripts for step in s.steps), disable=args.json,
               file=sys.stderr, unit="turn")
    try:
        for label, settings in compared:
            bar.set_description(label)
            summary, replies, stopped, session = Summary(), {}, [], None
            for si, script in enumerate(scripts):
                session = Session(model, settings, system=script.system or "default", sampling=sampling,
                                  seed=args.seed)
                try:
                    for i, step in enumerate(script.steps):
                        if step.kind == "set":  # a cache or sampling setting, the same for every entry
                            switched(session, step)
                            continue
                        try:
                            res = run_step(session, step, {})
                        except ValueError as exc:  # full past the model's positions, say: this script ends here
                            stopped.append(f"{script.name}, step {i + 1}: {exc}")
                            bar.update(sum(s.turn for s in script.steps[i:]))
                            break
                        summary.add(res)
                        for w in res.warnings:
                            tqdm.write(f"warning ({label}): {w}", file=sys.stderr)
                        if step.kind == "reply":
                            replies[(si, i)] = res.answer
                        if args.json:
                            print(json.dumps(turn_line(script, res, policy=settings.policy, label=label)),
                                  flush=True)
                        bar.update(1)
                finally:
                    session.close()
                summary.total_tokens += session.total_tokens
            totals = summary.as_dict(session)
            del totals["peak_rss_mb"]  # the process's so far, not this entry's
            rows.append({**totals, "label": label, "replies": len(replies), "stopped": stopped,
                         "decode_ms_per_token": _mean([r.decode_ms_per_token for r in summary.results])})
            answers.append(replies)
    finally:
        bar.close()
    for row, replies in zip(rows, answers):
        both = replies.keys() & answers[0].keys()
        row["same_replies_as"] = rows[0]["label"]
        row["same_replies"] = sum(1 for k in both if replies[k] == answers[0][k])
        row["replies_compared"] = len(both)
    print(json.dumps({"compare": rows}) if args.json else table(rows), flush=True)
    return 0


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def table(rows: list[dict]) -> str:
    """The comparison as a text table, a policy (or policy:budget) a row, then where any stopped."""
    first, width = rows[0]["label"], max(10, *(len(r["label"]) for r in rows))
    same_width = max(16, len("replies as " + first))
    head = (f"{'policy':{width}s} {'turns':>5s} {'hits':>7s} {'expect NLL':>10s} {'max cache':>9s} {'MiB':>6s} "
            f"{'evicted':>8s} {'replies as ' + first:>{same_width}s} {'ms/token':>8s} {'wall s':>7s}")
    lines = [head]
    for i, r in enumerate(rows):
        nll = f"{r['mean_expect_nll']:.3f}" if r["mean_expect_nll"] is not None else "-"
        same = "-" if i == 0 or not r["replies_compared"] else f"{r['same_replies']}/{r['replies_compared']}"
        ms = f"{r['decode_ms_per_token']:.1f}" if r["decode_ms_per_token"] is not None else "-"
        lines.append(f"{r['label']:{width}s} {r['turns']:5d} {r['hits']:>3d}/{r['expected']:<3d} {nll:>10s} "
                     f"{r['max_cache_tokens']:9,d} {r['max_cache_bytes'] / 2**20:6.1f} {r['evicted_tokens']:8,d} "
                     f"{same:>{same_width}s} {ms:>8s} {r['wall_s']:7.1f}")
    for r in rows:
        lines += [f"{r['label']} stopped at {where}" for where in r["stopped"]]
    return "\n".join(lines)
