"""The removability atlas (``softprior atlas``; docs/STUDY.md, "The atlas"): ``docs/ATLAS.md`` and its figure
``docs/atlas/atlas.png``, written from files alone, no store: the atlas's settings (``atlas/atlas.json``)
and each finished cell's verdicts (``atlas/cells/TASK-PRIOR.json``, a copy of its study's
``verdicts.json``, ``softprior.study.write_verdicts``), with ``atlas/NOTES.md``, the atlas's notes written by
hand, where it exists. A cell with no file is shown as "not run"."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["atlas_dir", "note_atlas", "read_atlas", "write_atlas"]

# verdict -> (colour, short mark); "partly ..." and "inconclusive ..." by their first word
_STYLE = {"reproduced": ("#4daf4a", "yes"), "not reproduced": ("#e41a1c", "no"), "partly": ("#ff9f40", "partly"),
          "inconclusive": ("#ffe066", "?"), "not applicable": ("#d0d0d0", "n/a"), "not measured": ("#ffffff", "–"),
          "refused": ("#984ea3", "refused"), "not run": ("#f4f4f4", "not run")}


def _kind(verdict: str) -> str:
    for k in ("not reproduced", "not applicable", "not measured", "not run", "reproduced", "partly", "inconclusive",
              "refused"):
        if verdict.startswith(k):
            return k
    return "not measured"


def atlas_dir(doc) -> Path:
    """Where the document's data and figure lie: ``atlas/`` beside it (docs/ATLAS.md: docs/atlas/)."""
    return Path(doc).parent / "atlas"


def note_atlas(doc, priors: list[str], tasks: list[str], claims: list[str], settings: dict) -> Path:
    """``atlas/atlas.json``: the atlas's rows (priors), columns (tasks) and claims, merged with those an
    earlier run noted (a run on a subset keeps the others' rows), and the settings of this run."""
    f = atlas_dir(doc) / "atlas.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(f.read_text()) if f.is_file() else {}

    def merged(key, new):
        return list(dict.fromkeys(list(old.get(key, [])) + list(new)))
    body = {**settings, "priors": merged("priors", priors), "tasks": merged("tasks", tasks),
            "claims": merged("claims", claims)}
    f.write_text(json.dumps(body, indent=1, sort_keys=True))
    return f


def read_atlas(doc) -> tuple[dict, dict]:
    """(settings, cells): atlas.json (empty if absent) and {(prior, task): the cell's verdicts}."""
    d = atlas_dir(doc)
    settings = json.loads((d / "atlas.json").read_text()) if (d / "atlas.json").is_file() else {}
    cells = {}
    for f in sorted((d / "cells").glob("*.json")):
        body = json.loads(f.read_text())
        cells[(body["prior"], body["task"])] = body
    return settings, cells


def _f(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def _interval(c: dict) -> str:
    if not c.get("measured"):
        return "not measured"
    if c.get("lo") is None or c.get("hi") is None:
        return f"{_f(c['est'])} (no interval)"
    return f"{_f(c['est'])} [{_f(c['lo'])}, {_f(c['hi'])}]"


def _claim_cell(cl: dict | None) -> str:
    if cl is None:
        return "–"
    kind = _kind(cl["verdict"])
    if kind == "not applicable":
        return "n/a (did not learn)"
    return f"**{cl['verdict']}**<br>" + "; ".join(_interval(c) for c in cl["conditions"])


def _layout(settings: dict, cells: dict) -> tuple[list[str], list[str], list[str]]:
    priors = list(dict.fromkeys(list(settings.get("priors", [])) + [p for p, _ in cells]))
    tasks = list(dict.fromkeys(list(settings.get("tasks", [])) + [t for _, t in cells]))
    claims = list(settings.get("claims", []))
    for body in cells.values():
        claims += [c["name"] for c in body["claims"] if c["name"] not in claims]
    return priors, tasks, claims


def _figure(path: Path, priors, tasks, claims, cells) -> None:
    """priors x claims per task, each square coloured by its verdict; the fade's zero-gate metric
    written in the 'fade keeps' column."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(tasks), 1, figsize=(1.25 * max(len(claims), 1) + 2.2,
                                                     0.5 * len(priors) * len(tasks) + 1.3 * len(tasks) + 0.8),
                             squeeze=False)
    for ax, task in zip(axes[:, 0], tasks):
        grid = []
        for i, prior in enumerate(priors):
            body = cells.get((prior, task))
            by = {c["name"]: c for c in body["claims"]} if body else {}
            row = []
            for j, name in enumerate(claims):
                kind = _kind(by[name]["verdict"]) if name in by else ("not measured" if body else "not run")
                row.append(to_rgb(_STYLE[kind][0]))
                text = _STYLE[kind][1]
                if name == "fade keeps" and body and body.get("fade_zero") is not None:
                    text = f"{text}\n{body['fade_zero']:.3f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
            grid.append(row)
        ax.imshow(grid or [[(1, 1, 1)]], aspect="auto")
        ax.set_xticks(range(len(claims)), claims, rotation=30, ha="right", fontsize=7)
        ax.set_yticks(range(len(priors)), priors, fontsize=8)
        ax.set_xticks([x - 0.5 for x in range(1, len(claims))], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, len(priors))], minor=True)
        ax.grid(which="minor", color="white", lw=2)
        ax.tick_params(which="minor", length=0)
        ax.set_title(f"{task} (in 'fade keeps': the fade's zero-gate metric)", fontsize=9)
    fig.legend(handles=[Patch(facecolor=c, edgecolor="gray", label=k) for k, (c, _) in _STYLE.items()],
               loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _options(b: dict) -> str:
    """The cell's chosen configuration: its search's axes at the chosen candidate (the label), else its
    record's task and model options but the family."""
    if b.get("candidate_label"):
        return b["candidate_label"]
    opts = {**(b.get("task_options") or {}), **(b.get("model_options") or {})}
    opts.pop("prior_family", None)
    return ", ".join(f"{k}={v}" for k, v in sorted(opts.items())) or "the defaults"


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _traits_table(priors, tasks, cells) -> list[str]:
    """Per cell, what distinguishes it (``study.traits``): the unforced models' prior, how local and how
    strong, when their circuit forms, beside the fade's window and what it keeps; "–" where a cell's
    verdicts predate the traits."""
    md = ["| prior | task | chosen configuration | locality (no prior) | strength | circuit forms at, per seed | "
          "fade window | fade zero-gate |", "|---|---|---|---|---|---|---|---|"]
    for p in priors:
        for t in tasks:
            b = cells.get((p, t))
            tr = (b or {}).get("traits")
            if not tr:
                what, fade = ("not run", "–") if b is None else (_options(b), _f(b.get("fade_zero")))
                md.append(f"| {p} | {t} | {what} | – | – | – | – | {fade} |")
                continue
            seeds, (start, end) = tr["seeds"], tr["fade_window"]
            forms = ("n/a (not an accuracy)" if b.get("metric") != "acc" else
                     ", ".join("never" if x["formation_step"] is None else str(x["formation_step"]) for x in seeds))
            md.append(f"| {p} | {t} | {_options(b)} | {_f(_mean(seeds, 'locality'))} ({_f(_mean(seeds, 'uniform'))}) "
                      f"| {_f(_mean(seeds, 'strength'))} | {forms or '–'} | {start}-{end} | {_f(b.get('fade_zero'))} |")
    return md


def write_atlas(doc) -> Path:
    """Write ``doc`` (docs/ATLAS.md) and ``atlas/atlas.png`` from ``atlas/`` beside it (``read_atlas``);
    the same files give the same document, byte for byte."""
    doc = Path(doc)
    settings, cells = read_atlas(doc)
    priors, tasks, claims = _layout(settings, cells)
    d = atlas_dir(doc)
    d.mkdir(parents=True, exist_ok=True)
    _figure(d / "atlas.png", priors, tasks, claims, cells)
    rel = f"{d.name}/atlas.png" if d.parent == doc.parent else str(d / "atlas.png")
    n_run = sum((p, t) in cells for p in priors for t in tasks)
    steps, seeds = settings.get("steps"), settings.get("seeds")
    cmd = settings.get("command", "softprior atlas")
    md = ["# The removability atlas", "",
          "<!-- written by `softprior atlas` (src/softprior/reports/atlas.py) from the files in "
          f"{d.name}/; `softprior atlas --report-only` rewrites it from them, no store needed -->", "",
          "Every registered prior family on each task: each cell is one `softprior study` (docs/STUDY.md), its own "
          "difficulty search, pre-registration, the paths and the robustness map, and its verdicts on intervals over "
          f"seeds. `{cmd}`" + (f": {steps} steps per run, {seeds} seed(s) per row." if steps else ".")
          + (f" Each cell's robustness map covers its {settings['map_limit']} nearest other candidate(s)."
             if settings.get("map_limit") is not None else ""), "",
          f"{n_run} of {len(priors) * len(tasks)} cell(s) run." + (
              " **A --quick atlas: too few steps and seeds for its verdicts to mean much.**" if settings.get("quick")
              else ""), "",
          "## Verdicts", "",
          "Each claim's verdict with each condition's estimate and 95% interval over seeds (docs/STUDY.md, "
          "\"The report\"); ceiling: the task's Bayes ceiling at the cell's chosen configuration; record: the "
          "calibration record the cell's claims rest on.", "",
          "| prior | task | ceiling | record | fade zero-gate | " + " | ".join(claims) + " |",
          "|---|---|---|---|---|" + "---|" * len(claims)]
    for p in priors:
        for t in tasks:
            b = cells.get((p, t))
            if b is None:
                md.append(f"| {p} | {t} | not run | | | " + " | ".join("not run" for _ in claims) + " |")
                continue
            by = {c["name"]: c for c in b["claims"]}
            md.append(f"| {p} | {t} | {_f(b['ceiling'])} | `{b['record'][:12]}` | {_f(b.get('fade_zero'))} | "
                      + " | ".join(_claim_cell(by.get(n)) for n in claims) + " |")
    md += ["", "## What distinguishes the cells", "",
           "The trained unforced models (one per seed) at their own gates (`softprior.study.traits`): how local "
           "the prior is (*locality*: the attention the gated prior alone gives a query's own and previous key, "
           "beside what no prior gives at this length), how strong (*strength*: the range of g_pos B^pos over a "
           "query's keys, in logits; `analysis.mechanism.prior_profile`), and the step at which the circuit forms "
           "(the normal metric past the study's \"learns\" level), beside the fade's window at the cell's budget "
           "and what the fade keeps at zero gate.", "", *_traits_table(priors, tasks, cells)]
    notes = d / "NOTES.md"
    if notes.is_file():
        md += ["", "## Notes", "", notes.read_text().strip()]
    md += ["", "## Figure", "", f"![atlas]({rel})", "",
           f"*{rel}*: per task, each prior (row) and claim (column) coloured by its verdict; in the 'fade keeps' "
           "column, the fade's zero-gate metric (mean over seeds).", "",
           "## The cells", "",
           "| prior | task | study | steps x seeds | metric (chance) | record registered | claims pre-registered "
           "| first prediction row stored | candidate |", "|---|---|---|---|---|---|---|---|---|"]
    for p in priors:
        for t in tasks:
            b = cells.get((p, t))
            if b is None:
                md.append(f"| {p} | {t} | not run | | | | | | |")
                continue
            md.append(f"| {p} | {t} | `{b['study']}`{' (quick)' if b.get('quick') else ''} | {b['steps']} x "
                      f"{b['seeds']} | {b['metric']} ({_f(b['chance'])}) | `{b['record']}` {b.get('registered_at') or ''} "
                      f"| {b.get('preregistered_at') or ''} | {b.get('first_prediction_row_at') or 'not known'} "
                      f"| {b.get('candidate')} |")
    md.append("")
    doc.write_text("\n".join(md))
    return doc
