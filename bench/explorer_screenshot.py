"""The README's picture of the attention explorer (``aiayn serve``'s ``GET /``): a trained model
translating a sentence, with one layer's cross-attention shown, taken in headless Chromium.

    python bench/explorer_screenshot.py --model runs/ding/model [--out docs/explorer.png]
"""

from __future__ import annotations

import argparse

from playwright.sync_api import sync_playwright

from aiayn.data.tokenizer import load_tokenizer
from aiayn.model import Transformer
from aiayn.serve import ServeOptions, create_app, serving
from aiayn.translator import Translator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--sentence", default="Es war purer Zufall.")
    parser.add_argument("--kind", default="decoder_cross", choices=["decoder_cross", "encoder", "decoder_self"])
    parser.add_argument("--layer", type=int, default=-1, help="default: the last")
    parser.add_argument("--chromium", default="/usr/lib/chromium/chromium")
    parser.add_argument("--out", default="docs/explorer.png")
    args = parser.parse_args()

    model = Transformer.from_pretrained(args.model).eval()
    translator = Translator(model, load_tokenizer(args.model, model.config.vocab_size))
    layer = args.layer % (model.config.N if args.kind == "encoder" else model.config.N_dec)
    with serving(create_app(translator, model, ServeOptions())) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True)
        page = browser.new_page(viewport={"width": 1000, "height": 760})
        page.goto(url)
        page.fill("#sentence", args.sentence)
        page.click("#translate")
        page.wait_for_function("!['', '…'].includes(document.querySelector('#translation').textContent.trim())")
        page.click("#show-attention")
        page.wait_for_selector("#heatmap rect.cell")
        page.select_option("#kind", args.kind)
        page.select_option("#layer", str(layer))
        page.hover("#heatmap rect.cell[data-row='1'][data-col='1']")
        page.screenshot(path=args.out, full_page=True)
        browser.close()
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
