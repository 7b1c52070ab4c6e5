"""The attention explorer in a real browser (headless Chromium driven by Playwright): type a
sentence, get `aiayn translate`'s translation; one click shows the attention, whose drawn
cross-attention rows are `aiayn.viz.translation_attention`'s; hovering highlights the tokens.
Skipped, saying why, where Playwright or Chromium (Debian's `chromium`) is missing."""

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed")

from aiayn.cli import main  # noqa: E402
from aiayn.data.tokenizer import load_tokenizer  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.serve import ServeOptions, create_app, serving  # noqa: E402
from aiayn.translator import Translator  # noqa: E402
from aiayn.viz import translation_attention  # noqa: E402
from serve_helpers import make_model_dir  # noqa: E402


def chromium() -> str | None:
    """Chromium's binary: $AIAYN_CHROMIUM, or Debian's (the real binary, not the wrapper script)."""
    for candidate in (os.environ.get("AIAYN_CHROMIUM"), "/usr/lib/chromium/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


pytestmark = pytest.mark.skipif(
    chromium() is None, reason="no Chromium: apt-get install chromium (Debian), or set AIAYN_CHROMIUM"
)
SENTENCE = "Der Hund bellt laut."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def page(model_dir):
    model = Transformer.from_pretrained(model_dir).eval()
    translator = Translator(model, load_tokenizer(model_dir, model.config.vocab_size))
    app = create_app(translator, model, ServeOptions())
    with serving(app) as url, playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.goto(url)
        yield page
        browser.close()


def test_translate_then_look_at_the_attention(page, model_dir, capsys, tmp_path):
    capsys.readouterr()
    assert main(["translate", "--model", str(model_dir), SENTENCE]) == 0  # beam 4, as the page's default
    expected = capsys.readouterr().out.split("\n")[0]

    page.fill("#sentence", SENTENCE)
    page.click("#translate")
    page.wait_for_function("document.querySelector('#translation').textContent.trim() !== '…'")
    assert page.text_content("#translation") == expected
    assert page.text_content("#error") == ""

    page.click("#show-attention")  # one click away
    page.wait_for_selector("#heatmap rect.cell")
    model = Transformer.from_pretrained(model_dir).eval()
    reference = translation_attention(model, load_tokenizer(model_dir), SENTENCE, beam=4)  # the page's beam
    assert page.text_content("#shown") == f"translation (beam 4): {expected}"
    assert reference.translation == expected  # the weights drawn are those of the translation shown
    layers, heads = len(reference.attention.decoder_cross), reference.attention.decoder_cross[0].size(0)
    for layer in range(layers):
        for head in range(heads):
            page.select_option("#kind", "decoder_cross")
            page.select_option("#layer", str(layer))
            page.select_option("#head", str(head))
            drawn = page.eval_on_selector_all(
                "#heatmap rect.cell",
                "cells => cells.map(c => [+c.dataset.row, +c.dataset.col, +c.getAttribute('fill-opacity')])",
            )
            weights = reference.attention.decoder_cross[layer][head]  # (T, S)
            assert len(drawn) == weights.numel()
            for i, j, opacity in drawn:
                assert abs(opacity - float(weights[i, j])) < 1e-6, (layer, head, i, j)
            assert len(page.query_selector_all("#thumbs figure")) == heads  # every head of the layer, small
    rows = page.eval_on_selector_all("#heatmap text.row-label", "ts => ts.map(t => t.textContent)")
    cols = page.eval_on_selector_all("#heatmap text.col-label", "ts => ts.map(t => t.textContent)")
    assert (rows, cols) == (reference.target, reference.source)  # tokens on both axes

    page.hover("#heatmap rect.cell[data-row='1'][data-col='2']")
    highlighted = page.eval_on_selector_all("#heatmap text.hl", "ts => ts.map(t => t.textContent)")
    assert highlighted == [reference.target[1], reference.source[2]]

    for kind, weights in (("encoder", reference.attention.encoder), ("decoder_self", reference.attention.decoder_self)):
        page.select_option("#kind", kind)
        page.select_option("#layer", "0")
        page.select_option("#head", "0")
        script = "cells => cells.map(c => +c.getAttribute('fill-opacity'))"
        drawn = page.eval_on_selector_all("#heatmap rect.cell", script)
        assert drawn == pytest.approx(weights[0][0].flatten().tolist(), abs=1e-6)

    shot = Path(os.environ.get("AIAYN_EXPLORER_SCREENSHOT", tmp_path / "explorer.png"))
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def test_bad_input_shows_the_servers_error(page):
    page.fill("#sentence", "x" * 2001)
    page.click("#translate")
    page.wait_for_function("document.querySelector('#error').textContent !== ''")
    assert "2001 characters, at most 2000" in page.text_content("#error")
