"""Trajectory renderers: the self-contained HTML page and the terminal animation."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from elflow.generation.trajectory import (
    _fit,
    animate_terminal,
    changed_words,
    frame_words,
    render_html,
)

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
    page = render_html(FRAMES, {"sampler": "sde", "note": "<i>x</i>"}, ["s1", "s2", "final"])
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
