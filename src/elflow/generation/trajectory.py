"""Show a sampling trajectory: text condensing out of noise, step by step (ELF_SPEC §10).

A trajectory is ``frames[k][i]``: sample i's decoded text after step k (the decode-mode argmax of
that step's x_hat), usually followed by the final samples. :func:`render_html` writes one
self-contained page (inline CSS/JS, data in a JSON block, nothing fetched) with a slider, a play
button and the words that changed since the previous step highlighted; :func:`animate_terminal`
replays it with ANSI codes. Generated text is untrusted: it is HTML-escaped in the page and only
ever inserted with ``textContent`` by the script (ELF_SPEC §10, "Safety"). :func:`page_settings`
turns a sample record's settings into the page's table in plain words (what w, gamma and the
projection mean, which steps the projection touched), with values as a user writes them.
"""

from __future__ import annotations

import difflib
import html
import json
import math
import shutil
import sys
import time
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from elflow.config import SAMPLERS


def changed_words(prev: Sequence[str], cur: Sequence[str]) -> list[int]:
    """Indices of ``cur``'s words that are not matched in ``prev`` (a word-level diff).

    A diff rather than a position-wise comparison: WordPiece merges and the EOS cut change the
    number of words, and one inserted word should not mark the rest of the line as changed.
    """
    matcher = difflib.SequenceMatcher(a=list(prev), b=list(cur), autojunk=False)
    kept: set[int] = set()
    for block in matcher.get_matching_blocks():
        kept.update(range(block.b, block.b + block.size))
    return [j for j in range(len(cur)) if j not in kept]


def frame_words(frames: Sequence[Sequence[str]]) -> tuple[list[list[list[str]]], list]:
    """Split every text on whitespace -> (words[k][i], changed[k][i]); step 0 is all new."""
    words = [[text.split() for text in frame] for frame in frames]
    changed = []
    for k, frame in enumerate(words):
        if k == 0:
            changed.append([list(range(len(ws))) for ws in frame])
        else:
            changed.append([changed_words(words[k - 1][i], ws) for i, ws in enumerate(frame)])
    return words, changed


def _check_frames(frames: Sequence[Sequence[str]], labels: Sequence[str] | None) -> list[str]:
    if not frames:
        raise ValueError("a trajectory needs at least one frame")
    n = len(frames[0])
    if any(len(frame) != n for frame in frames):
        raise ValueError("every frame must hold one text per sample")
    if labels is None:
        labels = [f"step {k + 1}/{len(frames)}" for k in range(len(frames))]
    if len(labels) != len(frames):
        raise ValueError(f"{len(labels)} labels for {len(frames)} frames")
    return list(labels)


def plain(value: Any) -> str:
    """A setting as a user writes it: no Python ``None``/``True``/``False``, numbers as typed
    (``1`` for 1.0, ``0.3`` for 0.3)."""
    if value is None:
        return "off"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def model_label(model: str) -> str:
    """How a page names the model: the shipped demo model by name, a local folder or file by its
    own name (a checkpoint with its run's), a Hub id as given; never a local absolute path."""
    from elflow.io.model_sources import DEMO_MODEL

    if model == "demo":
        return "the shipped demo model"
    path = Path(model).expanduser()
    if not (path.exists() or path.is_absolute()):
        return model  # a Hub id
    path = path.resolve()
    if path == DEMO_MODEL:
        return "the shipped demo model"
    if path.name.startswith("checkpoint"):
        return f"{path.parent.name}/{path.name}"
    return path.name


def _projected_steps(s: Mapping[str, Any], start: float) -> str:
    """Which steps projected sampling touched: the steps whose network evaluation is at
    t >= ``start`` (exact on the uniform grid; on the logit-normal grid, drawn per sample, the
    expected count)."""
    steps = int(s["steps"])
    if s.get("time_grid") == "uniform":
        import torch

        t = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64)
        at = t[:-1]
        spec = SAMPLERS.get(s.get("sampler", ""))
        if spec is not None and spec.eval_time is not None:  # e.g. the SDE's, stepped back;
            # not the last step, which is plain Euler (elflow.sampling.sample_loop.sample)
            back = spec.eval_time(at, t[1:], s)
            at = torch.cat([back[:-1], at[-1:]])
        touched = [k + 1 for k in range(steps) if at[k] >= start]
        if not touched:
            return f"no step of the {steps} on this evenly spaced grid reaches t = {start:g}"
        first = touched[0]
        which = f"step {first}" if first == steps else f"steps {first}–{steps}"
        return f"on this evenly spaced grid, {which} of {steps}"
    if start <= 0:
        return f"all {steps} steps"
    mean, std = float(s.get("time_mean") or 0.0), float(s.get("time_std") or 1.0)
    z = (math.log(start / (1.0 - start)) - mean) / std
    expected = (steps - 1) * 0.5 * math.erfc(z / math.sqrt(2.0))  # interior times >= start
    return (
        "the step times are drawn afresh for each sample, so these are different steps in each "
        f"sample: about {expected:.0f} of the {steps} on average"
    )


def page_settings(s: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """A sample record's settings (:func:`elflow.generation.records.settings_record`) as the
    page's table: setting -> (value as a user writes it, what it means)."""
    rows: dict[str, tuple[str, str]] = {}
    if s.get("model"):
        rows["model"] = (model_label(str(s["model"])), "")
    spec = SAMPLERS.get(s["sampler"])
    name, what = (spec.title, spec.description) if spec else (s["sampler"], "")
    rows["sampler"] = (name, what)
    nfe = s.get("nfe", s["steps"])
    rows["steps"] = (
        plain(s["steps"]),
        f"from noise (t = 0) to text (t = 1); {plain(nfe)} network evaluations per sample",
    )
    if s.get("gamma") is not None:  # a sampler that uses gamma (the SDE)
        what = "the SDE's noise re-injection: how much noise each step puts back (0: the ODE)"
        schedule = s.get("gamma_schedule") or "constant"
        if schedule != "constant":
            what += f"; {schedule} schedule: this much at t = 0, falling to 0 at t = 1"
        rows["gamma"] = (plain(s["gamma"]), what)
    else:
        rows["gamma"] = ("not used", "the SDE's noise re-injection; this sampler puts none back")
    if s.get("pc_snr") is not None:
        rows["corrector"] = (plain(s["pc_snr"]), "the Langevin move's signal-to-noise ratio")
    rows["w"] = (
        plain(s["w"]),
        "self-conditioning guidance scale: how far each step's estimate is pushed from the one "
        "made without the previous step's estimate towards, and past, the one made with it "
        "(1: no guidance)",
    )
    if s.get("cfg") is not None:
        rows["cfg"] = (plain(s["cfg"]), "classifier-free guidance on the source (1: none)")
    if s.get("time_grid") == "uniform":
        rows["time grid"] = ("evenly spaced", "the times of the steps")
    else:
        rows["time grid"] = (
            f"logit-normal, mean {plain(s.get('time_mean'))}, scale {plain(s.get('time_std'))}",
            "the times of the steps, drawn afresh for each sample, most of them near the noise",
        )
    start = s.get("project_from")
    if start is None or start >= 1:
        rows["projection"] = ("off", "projected sampling (an elflow addition) was not used")
    else:
        rows["projection"] = (
            f"from t = {plain(start)}",
            f"at the steps at t ≥ {plain(start)}, the network's clean-text estimate was replaced "
            "by the encoder's latents of the text it decodes to; "
            + _projected_steps(s, float(start)),
        )
    if "seed" in s:
        rows["seed"] = (plain(s["seed"]), "sample i depends only on the seed and i")
    if "length" in s:
        rows["length"] = (f"{plain(s['length'])} tokens", "the room each sample has")
    if "dtype" in s:
        rows["precision"] = (plain(s["dtype"]), "")
    if "ema" in s:
        rows["weights"] = ("EMA" if s["ema"] else "training weights", "")
    return rows


def _script_json(obj: Any) -> str:
    # NOTE: inside <script> the HTML parser ends the block at the first "</"; escaping every
    # <, > and & as JSON unicode escapes keeps any generated text inert and the JSON unchanged.
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_CSS = """
body{font:15px/1.5 system-ui,sans-serif;margin:1.5em auto;max-width:60em;padding:0 1em;color:#222}
h1{font-size:1.3em}table.meta{border-collapse:collapse;font-size:.85em;margin-bottom:1em}
table.meta td{border:1px solid #ddd;padding:2px 8px;vertical-align:top}
table.meta td.what{color:#555}p.about{font-size:.9em;color:#444}
.controls{position:sticky;top:0;background:#fff;padding:.5em 0;border-bottom:1px solid #ddd}
#step{width:60%;vertical-align:middle}#label{font-weight:600;margin-left:.5em}
.sample{border-left:3px solid #8ab;padding:.3em .8em;margin:.8em 0;white-space:pre-wrap;
font-family:ui-monospace,monospace;font-size:.9em}.sid{color:#888;font-size:.8em}
.chg{background:#ffe08a;border-radius:2px}
.keep{color:#1a5d8a;font-weight:600}
"""

_JS = """
(function(){
  var data = JSON.parse(document.getElementById('elflow-data').textContent);
  var slider = document.getElementById('step'), label = document.getElementById('label');
  var play = document.getElementById('play'), boxes = document.querySelectorAll('.text');
  var timer = null;
  slider.max = data.labels.length - 1;
  function show(k){
    label.textContent = data.labels[k];
    for (var i = 0; i < boxes.length; i++){
      var box = boxes[i], words = data.words[k][i], changed = {};
      data.changed[k][i].forEach(function(j){ changed[j] = true; });
      while (box.firstChild) box.removeChild(box.firstChild);
      for (var j = 0; j < words.length; j++){
        if (j) box.appendChild(document.createTextNode(' '));
        var span = document.createElement('span');
        span.textContent = words[j];  // never innerHTML: the text is untrusted
        var cls = [];
        if (changed[j]) cls.push('chg');
        if (data.kept && data.kept[k][i].indexOf(j) >= 0) cls.push('keep');
        span.className = cls.join(' ');
        box.appendChild(span);
      }
    }
  }
  function stop(){ clearInterval(timer); timer = null; play.textContent = 'play'; }
  slider.addEventListener('input', function(){ stop(); show(+slider.value); });
  play.addEventListener('click', function(){
    if (timer){ stop(); return; }
    if (+slider.value >= +slider.max) slider.value = 0;
    play.textContent = 'pause'; show(+slider.value);
    timer = setInterval(function(){
      if (+slider.value >= +slider.max){ stop(); return; }
      slider.value = +slider.value + 1; show(+slider.value);
    }, 350);
  });
  slider.value = slider.max; show(+slider.max);
})();
"""


def kept_words(words: Sequence[str], runs: Sequence[str]) -> list[int]:
    """Indices of ``words`` that belong to the kept text ``runs`` (matched in order, whole)."""
    found: list[int] = []
    at = 0
    for run in runs:
        want = run.split()
        for i in range(at, len(words) - len(want) + 1):
            if list(words[i : i + len(want)]) == want:
                found += range(i, i + len(want))
                at = i + len(want)
                break
    return found


def render_html(
    frames: Sequence[Sequence[str]],
    meta: Mapping[str, Any],
    labels: Sequence[str] | None = None,
    kept: Sequence[Sequence[str]] | None = None,
) -> str:
    """A self-contained HTML page for ``frames[k][i]`` (step k, sample i).

    Args:
        frames: per step, one decoded text per sample.
        meta: settings shown in a table at the top: a value, or a (value, what it means) pair
            (:func:`page_settings`); values are written as a user writes them and escaped.
        labels: one label per frame (default "step k/N").
        kept: infilling: each sample's kept text runs, shown distinctly (bold, blue).
    """
    labels = _check_frames(frames, labels)
    words, changed = frame_words(frames)
    table = {
        str(k): (plain(v[0]), str(v[1])) if isinstance(v, tuple) else (plain(v), "")
        for k, v in meta.items()
    }
    data = {"labels": labels, "words": words, "changed": changed}
    if kept is not None:
        data["kept"] = [
            [kept_words(frame[i], kept[i]) for i in range(len(frame))] for frame in words
        ]
        table["kept text"] = ("bold blue", "the text you gave, held fixed while the gaps fill")
    data["meta"] = {k: v for k, (v, _) in table.items()}
    esc = html.escape
    rows = "".join(
        f'<tr><td>{esc(k)}</td><td>{esc(v)}</td><td class="what">{esc(what)}</td></tr>'
        for k, (v, what) in table.items()
    )
    # Without JavaScript the page still shows the last frame (escaped here, server side).
    samples = "".join(
        f'<div class="sample"><div class="sid">sample {i}</div>'
        f'<div class="text">{esc(text)}</div></div>'
        for i, text in enumerate(frames[-1])
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>elflow trajectory</title>"
        f"<style>{_CSS}</style></head><body>"
        "<h1>elflow sampling trajectory</h1>"
        '<p class="about">Sampling moves each text from noise to words in steps. Each step here '
        "shows the text the model would give if it stopped there (its clean-text estimate, "
        "decoded); words that changed since the previous step are highlighted. Drag the slider "
        "or press play to move through the steps.</p>"
        f'<table class="meta">{rows}</table>'
        '<div class="controls"><button id="play" type="button">play</button> '
        f'<input id="step" type="range" min="0" max="{len(frames) - 1}" step="1" '
        f'value="{len(frames) - 1}" aria-label="step">'
        f'<span id="label">{esc(labels[-1])}</span></div>'
        f"{samples}"
        f'<script type="application/json" id="elflow-data">{_script_json(data)}</script>'
        f"<script>{_JS}</script></body></html>\n"
    )


def _cells(word: str) -> int:
    """Terminal columns of ``word``: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in word)


def _fit(words: list[str], changed: set[int], width: int | None, color: bool) -> str:
    out, used = [], 0
    for j, word in enumerate(words):
        cells = _cells(word)
        if width is not None and used + cells + 1 > width:
            out.append("…")
            break
        used += cells + 1
        out.append(f"\x1b[30;43m{word}\x1b[0m" if color and j in changed else word)
    return " ".join(out)


def animate_terminal(
    frames: Sequence[Sequence[str]],
    stream: TextIO | None = None,
    delay: float = 0.15,
    labels: Sequence[str] | None = None,
) -> None:
    """Replay ``frames`` in a terminal, rewriting the lines in place (changed words highlighted).

    When ``stream`` is not a TTY (a pipe, a file, a test) only the final frame is printed, as
    plain text.
    """
    stream = stream if stream is not None else sys.stdout
    labels = _check_frames(frames, labels)
    words, changed = frame_words(frames)
    last = len(frames) - 1
    size = shutil.get_terminal_size()
    tty = hasattr(stream, "isatty") and stream.isatty()
    # More lines than the terminal has rows, or a terminal too narrow for the step label, cannot
    # be rewritten in place (a wrapped line breaks the "n lines up" redraw): final frame only.
    narrow = size.columns < len(f"[{labels[last]}]") + 1 or size.columns < 20
    if not tty or len(words[last]) + 1 >= size.lines or narrow:
        stream.write(f"[{labels[last]}]\n")
        stream.writelines(f"{i:>3}  {' '.join(ws)}\n" for i, ws in enumerate(words[last]))
        stream.flush()
        return
    # Lines are cut to the terminal width while animating: a wrapped line would break the
    # cursor arithmetic ("n lines up"). The last frame is printed whole.
    width = size.columns - 6
    drawn = 0
    for k in range(len(frames)):
        lines = [f"\x1b[1m[{labels[k]}]\x1b[0m"] + [
            f"{i:>3}  {_fit(ws, set(changed[k][i]), None if k == last else width, True)}"
            for i, ws in enumerate(words[k])
        ]
        prefix = f"\x1b[{drawn}F\x1b[J" if drawn else ""
        stream.write(prefix + "\n".join(lines) + "\n")
        stream.flush()
        drawn = len(lines)
        if k < last:
            time.sleep(delay)
