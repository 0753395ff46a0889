"""``elflow compare``: cells paired at matched entropy, verdicts beyond the intervals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elflow.__main__ import main
from elflow.errors import ELFError
from elflow.evaluation import sweep_plan as sweep
from elflow.evaluation.comparison import compare, load_result, markdown


def _sweep(folder, cells):
    """A sweep folder's table: cells of (name, gen_ppl, lo, hi, entropy, steps)."""
    folder.mkdir()
    rows = [
        sweep.table_row(
            name,
            {"sampler": "sde", "steps": steps, "nfe": steps, "w": 3.0, "gamma": 1.0},
            {"gen_ppl": ppl, "gen_ppl_ci": [lo, hi], "entropy": ent},
            1.0,
        )
        for name, ppl, lo, hi, ent, steps in cells
    ]
    rows.append(sweep.table_row("reference", {}, {"gen_ppl": 1.0, "entropy": 3.0}, None))
    sweep.write_tables(folder, rows, "paper")
    return folder


@pytest.fixture
def two(tmp_path):
    a = _sweep(
        tmp_path / "a",
        [
            ("n8", 100.0, 90.0, 110.0, 3.00, 8),  # vs b/n8: lower beyond both intervals
            ("n32", 60.0, 50.0, 70.0, 3.20, 32),  # vs b/n32: overlapping
            ("n64", 40.0, 35.0, 45.0, 2.50, 64),  # no B cell within the tolerance
        ],
    )
    b = _sweep(
        tmp_path / "b",
        [("n8", 150.0, 130.0, 170.0, 3.02, 8), ("n32", 65.0, 55.0, 75.0, 3.17, 32)],
    )
    return a, b


def test_pairs_within_tolerance_and_verdicts(two):
    a, b = (load_result(p) for p in two)
    assert [c.cell for c in a] == ["n8", "n32", "n64"]  # the real-text row is not a cell
    (comp,) = compare([a, b], tolerance=0.05)
    assert [(x.cell, y.cell, v) for x, y, v in comp.pairs] == [("n8", "n8", 1), ("n32", "n32", 0)]
    assert comp.counts == (1, 1, 0)
    (wide,) = compare([a, b], tolerance=0.25)  # n8 (3.00) and n32 (3.17) now pair across too
    assert len(wide.pairs) == 4
    (same,) = compare([a, b], tolerance=0.25, same=["steps"])
    assert len(same.pairs) == 2
    (flipped,) = compare([b, a], tolerance=0.05)
    assert flipped.counts == (0, 1, 1)
    text = markdown([comp], 0.05)
    assert "| n8 | 3.000 | 100.00 [90.00, 110.00] | n8 | 3.020 | 150.00 [130.00, 170.00] | A |" in (
        text
    )
    assert "A vs B: 1 wins, 1 overlaps, 0 losses for A in 2 pairs" in text
    (one,) = compare([b], tolerance=0.5)  # one result: its cells with each other
    assert [(x.cell, y.cell) for x, y, _ in one.pairs] == [("n8", "n32")]
    assert "no pair of cells" in markdown(compare([a, b], tolerance=0.001), 0.001)
    with pytest.raises(ELFError, match="not a cell setting"):
        compare([a, b], same=["colour"])
    with pytest.raises(ELFError, match="tolerance= must be a finite number"):
        compare([a, b], tolerance=-1)


def test_a_score_metrics_file_is_one_cell(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"gen_ppl": 80.0, "gen_ppl_ci": [70.0, 90.0], "entropy": 3.0}))
    (cell,) = load_result(path)
    assert (cell.cell, cell.gen_ppl_lo, cell.entropy) == ("m", 70.0, 3.0)
    path.write_text(json.dumps({"bleu": 3.0}))
    with pytest.raises(ELFError, match="no gen_ppl"):
        load_result(path)
    with pytest.raises(ELFError, match=r"no table\.csv"):
        load_result(tmp_path)


def test_cli_prints_and_writes_json_without_torch(two, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert main(["compare", *map(str, two), "--out", str(out)]) == 0
    assert "A vs B: 1 wins, 1 overlaps, 0 losses" in capsys.readouterr().out
    saved = json.loads(out.read_text())["comparisons"][0]
    assert (saved["wins"], saved["overlaps"], saved["losses"]) == (1, 1, 0)
    assert saved["pairs"][0]["lower"] == "a" and saved["pairs"][1]["lower"] is None
    assert main(["compare", str(two[0]), "--out", str(out)]) == 2  # exists: --overwrite
    code = (
        "import sys; from elflow.__main__ import main; "
        f"main(['compare', {str(two[0])!r}, {str(two[1])!r}]); "
        "print('torch' in sys.modules)"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.strip().endswith("False")
