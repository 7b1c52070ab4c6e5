"""Plots: attention maps of a translation (§3.2), positional encodings (§3.5), the learning-rate
schedule (§5.3), and their command lines. The plotted arrays are checked against independent truth."""

import inspect
import itertools
import json
import math
import struct
from pathlib import Path

import pytest
import torch
import yaml

from aiayn import viz
from aiayn.cli import main
from aiayn.data.tokenizer import TOKENIZER_NAME, Tokenizer
from aiayn.model import ModelConfig, Transformer
from helpers import randomize_

SENTENCE = "Das Haus ist groß."


def _tiny_config(tokenizer: Tokenizer, **options) -> ModelConfig:
    return ModelConfig(vocab_size=tokenizer.vocab_size, N=2, d_model=16, d_ff=32, h=2, P_drop=0.0, **options)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random model with a real tokenizer, saved as `aiayn train` saves one."""
    tokenizer = Tokenizer.train(["Das Haus ist groß.", "Die Katze schläft.", "Es war purer Zufall."] * 5, 300)
    torch.manual_seed(0)
    config = _tiny_config(tokenizer)
    directory = tmp_path_factory.mktemp("model")
    randomize_(Transformer(config), 0).save_pretrained(directory)  # every parameter random: biases, layer norms
    tokenizer.save(directory / TOKENIZER_NAME)
    return directory


@pytest.fixture(scope="module")
def loaded(model_dir):
    return Transformer.from_pretrained(model_dir).eval(), Tokenizer.load(model_dir / TOKENIZER_NAME)


@pytest.fixture(scope="module")
def maps(loaded):
    return viz.translation_attention(*loaded, SENTENCE, max_len=6)


def test_maps_are_those_of_the_greedy_translation(loaded, maps):
    """Teacher forcing on the model's own output gives the weights of each cached decoding step."""
    model, tokenizer = loaded
    src = torch.tensor([[*tokenizer.encode(SENTENCE), tokenizer.eos_id]])
    assert maps.source == tokenizer.pieces(src[0].tolist()) and maps.source[-1] == "</s>"
    assert maps.target[0] == "<s>" and len(maps.target) == 6  # no EOS within max_len: the 6 steps run
    S, T = src.size(1), len(maps.target)
    assert [w.shape for w in maps.attention.encoder] == [(2, S, S)] * 2
    assert [w.shape for w in maps.attention.decoder_self] == [(2, T, T)] * 2
    assert [w.shape for w in maps.attention.decoder_cross] == [(2, T, S)] * 2
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask)
        token, cross = torch.tensor([[tokenizer.bos_id]]), []
        for _ in range(T):
            out = model.decode(token, cache=cache, return_attention=True)
            cross.append([w[0, :, -1] for w in out.cross_attention])  # per layer (H, S)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    for layer in range(2):
        step_by_step = torch.stack([step[layer] for step in cross], dim=1)  # (H, T, S)
        torch.testing.assert_close(maps.attention.decoder_cross[layer], step_by_step)


def _torch_self_attention_weights(attention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """Per-head softmax(QKᵀ/√d_k) (§3.2.1, eq. 1) of ``x`` (1, L, d_model) by torch.nn.MultiheadAttention
    loaded with the sublayer's [W^Q; W^K; W^V]: (H, L, L)."""
    mha = torch.nn.MultiheadAttention(x.size(-1), attention.h, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(attention.in_proj.weight)
        mha.in_proj_bias.copy_(attention.in_proj.bias)
        L = x.size(1)
        later = torch.ones(L, L, dtype=torch.bool).triu(1) if causal else None  # torch: True = may NOT attend
        _, weights = mha(x, x, x, attn_mask=later, need_weights=True, average_attn_weights=False)
    return weights[0]


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_self_attention_maps_are_each_layers_and_heads_own(loaded, norm_first):
    """Encoder and decoder self-attention maps, layer by layer and head by head, equal
    torch.nn.MultiheadAttention's weights for that layer's input and in_proj: no layers or heads
    swapped. One unpadded sentence: the encoder attends everywhere, the decoder causally."""
    model, tokenizer = loaded
    if norm_first:
        torch.manual_seed(1)
        model = randomize_(Transformer(_tiny_config(tokenizer, norm_first=True)).eval(), 1)
    inputs = {}  # (stack, layer) -> the self-attention's input in the last forward: the teacher-forced one
    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda module, args, key=(stack, i): inputs.update({key: args[0]}))
        for stack in ("encoder", "decoder")
        for i, layer in enumerate(getattr(model, stack).layers)
    ]
    try:
        maps = viz.translation_attention(model, tokenizer, SENTENCE, max_len=6)
    finally:
        for hook in hooks:
            hook.remove()
    S, T = len(maps.source), len(maps.target)
    for stack, field, length in (("encoder", "encoder", S), ("decoder", "decoder_self", T)):
        plotted = getattr(maps.attention, field)
        assert len(plotted) == 2
        for layer, sublayer in enumerate(getattr(model, stack).layers):
            x = inputs[stack, layer]
            assert x.shape == (1, length, 16)
            truth = _torch_self_attention_weights(sublayer.self_attn, x, causal=stack == "decoder")
            for head in range(2):
                torch.testing.assert_close(plotted[layer][head], truth[head])
        # the check has teeth: no two (layer, head) maps are alike, so a swap would show
        for a, b in itertools.combinations([w for weights in plotted for w in weights], 2):
            assert (a - b).abs().max() > 1e-3


def test_decoder_inputs_stop_before_eos(loaded, monkeypatch):
    model, tokenizer = loaded
    output = [7, 8, tokenizer.eos_id, tokenizer.pad_id]
    monkeypatch.setattr("aiayn.decode.greedy_decode", lambda model, src, max_len=None: torch.tensor([output]))
    maps = viz.translation_attention(model, tokenizer, SENTENCE)
    assert maps.target == tokenizer.pieces([tokenizer.bos_id, 7, 8])  # <s> 7 predicted 8, 8 predicted </s>
    assert maps.translation == tokenizer.decode(output)
    assert maps.attention.decoder_cross[0].shape[1] == 3


def test_beam_maps_are_those_of_the_beam_translation(loaded):
    """With ``beam``, the decoder rows follow beam search's best output; each row's weights are
    the ones the cached decoder computed at that step of its path (causality)."""
    from aiayn.decode import beam_search

    model, tokenizer = loaded
    src = torch.tensor([[*tokenizer.encode(SENTENCE), model.config.eos_id]])
    best = beam_search(model, src, beam=3, alpha=0.6, max_len=8)[0][0].tokens
    maps = viz.translation_attention(model, tokenizer, SENTENCE, max_len=8, beam=3)
    assert maps.translation == tokenizer.decode(best)
    tgt = [model.config.bos_id, *best]
    assert maps.target == tokenizer.pieces(tgt[: len(maps.target)])
    with torch.no_grad():  # step by step on the KV cache, as the search ran
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask)
        for t, token in enumerate(tgt[: len(maps.target)]):
            out = model.decode(torch.tensor([[token]]), cache=cache, return_attention=True)
            for layer, weights in enumerate(out.cross_attention):
                torch.testing.assert_close(weights[0, :, 0], maps.attention.decoder_cross[layer][:, t])


def test_a_source_longer_than_the_model_is_truncated_with_a_warning(loaded):
    model, tokenizer = loaded
    model = Transformer(model.config.replace(max_len=24)).eval()  # sinusoidal: any max_len, same weights
    model.load_state_dict(loaded[0].state_dict())
    long = " ".join([SENTENCE] * 10)
    assert len(tokenizer.encode(long)) > model.config.max_len
    with pytest.warns(UserWarning, match="truncated to the model's"):
        maps = viz.translation_attention(model, tokenizer, long, max_len=4)
    assert len(maps.source) == model.config.max_len  # max_len - 1 tokens and EOS


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_plot_attention_grid_rows_sum_to_one_tokens_on_axes(maps, tmp_path):
    out = tmp_path / "attention.png"
    fig = viz.plot_attention(maps, out=out)
    assert len(fig.axes) == 3 * 2 * 2  # kinds × layers × heads
    width, height = _png_size(out)
    assert (width, height) == tuple(round(x * 100) for x in fig.get_size_inches())
    assert height > width  # 6 rows (kind, layer) of 2 heads
    fields = {"encoder": "enc", "decoder_self": "dec", "decoder_cross": "cross"}
    axes = iter(fig.axes)
    for field, kind in fields.items():
        rows = maps.source if kind == "enc" else maps.target
        columns = maps.target if kind == "dec" else maps.source
        for layer in range(2):
            for head in range(2):
                ax = next(axes)
                plotted = torch.as_tensor(ax.images[0].get_array())
                torch.testing.assert_close(plotted.sum(-1), torch.ones(len(rows)))
                torch.testing.assert_close(plotted, getattr(maps.attention, field)[layer][head])
                assert [t.get_text() for t in ax.get_yticklabels()] == rows
                assert [t.get_text() for t in ax.get_xticklabels()] == columns
                assert ax.get_title().endswith(f"layer {layer}, head {head}")
    decoder_self = torch.as_tensor(fig.axes[4].images[0].get_array())
    assert torch.equal(decoder_self.triu(1), torch.zeros_like(decoder_self))  # no attention to later positions


def test_plot_attention_selects_kinds_layers_heads(maps):
    fig = viz.plot_attention(maps, kinds=["cross", "enc"], layers=[1], heads=[0])
    assert [ax.get_title() for ax in fig.axes] == [
        "encoder-decoder attention, layer 1, head 0",
        "encoder self-attention, layer 1, head 0",
    ]
    with pytest.raises(ValueError, match="0 to 1"):
        viz.plot_attention(maps, layers=[2])
    with pytest.raises(ValueError, match="0 to 1"):
        viz.plot_attention(maps, heads=[0, 5])
    with pytest.raises(ValueError, match="choose from enc, dec, cross"):
        viz.plot_attention(maps, kinds=["self"])


def test_an_attention_grid_too_large_to_draw_is_an_error(maps, monkeypatch):
    many = maps._replace(source=maps.source * 100)  # panels of 100× the tokens: over 100 inches each
    with pytest.raises(ValueError, match=r"would be \d+ x \d+ pixels .*fewer kinds, layers or heads"):
        viz.plot_attention(many)
    monkeypatch.setattr(viz, "MAX_PIXELS", 2 * 10**5)  # a total of pixels, not only a side, is bounded
    with pytest.raises(ValueError, match="pixels"):
        viz.plot_attention(maps)
    assert len(viz.plot_attention(maps, kinds=["cross"], layers=[0], heads=[0]).axes) == 1


def _assert_positional_encoding(fig, L: int, d: int) -> None:
    """The heatmap of ``fig`` is PE of §3.5 for L positions and d_model = d."""
    plotted = torch.as_tensor(fig.axes[0].images[0].get_array(), dtype=torch.float64)
    expected = torch.empty(L, d, dtype=torch.float64)
    for pos in range(L):
        for i in range(d // 2):
            expected[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d))  # PE(pos, 2i)
            expected[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d))  # PE(pos, 2i+1)
    torch.testing.assert_close(plotted, expected, atol=1e-6, rtol=0)


def test_positional_encoding_plot_is_the_formula(tmp_path):
    fig = viz.plot_positional_encoding(50, 16, out=tmp_path / "pe.png")
    _assert_positional_encoding(fig, 50, 16)
    assert (tmp_path / "pe.png").stat().st_size > 10_000


def test_schedule_plot_is_the_formula_and_peaks_at_warmup():
    d_model, warmup = 512, 4000
    fig = viz.plot_schedule(d_model, warmup, steps=10_000)
    steps, lr = fig.axes[0].lines[0].get_data()
    assert steps[0] == 1 and steps[-1] == 10_000
    for step in (1, 100, 3999, 4000, 4001, 10_000):
        assert lr[step - 1] == pytest.approx(d_model**-0.5 * min(step**-0.5, step * warmup**-1.5), rel=1e-12)
    assert steps[lr.argmax()] == warmup
    assert lr.max() == pytest.approx(1 / math.sqrt(d_model * warmup))


def _spy(monkeypatch, name: str) -> list:
    """Replace ``viz.<name>`` by a wrapper that records ``(arguments by name, figure)`` of each call."""
    calls, real = [], getattr(viz, name)

    def spy(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append((bound.arguments, real(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(viz, name, spy)
    return calls


def _panel_grid(fig) -> tuple[list[str], tuple[int, int]]:
    """The panel titles, in reading order, and the (rows, columns) of the grid they sit in."""
    (grid,) = {ax.get_subplotspec().get_gridspec() for ax in fig.axes}
    return [ax.get_title() for ax in fig.axes], grid.get_geometry()


def test_attention_command(model_dir, tmp_path, capsys, monkeypatch):
    calls = _spy(monkeypatch, "plot_attention")
    out = tmp_path / "maps.png"
    argv = ["attention", "--model", str(model_dir), SENTENCE, "--out", str(out)]
    assert main([*argv, "--kind", "enc,cross", "--layers", "1", "--heads", "0,1"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{SENTENCE}  ->  ") and f"written {out}" in printed
    arguments, fig = calls[-1]
    assert (arguments["kinds"], arguments["layers"], arguments["heads"]) == (["enc", "cross"], [1], [0, 1])
    assert _panel_grid(fig) == (
        [
            "encoder self-attention, layer 1, head 0",
            "encoder self-attention, layer 1, head 1",
            "encoder-decoder attention, layer 1, head 0",
            "encoder-decoder attention, layer 1, head 1",
        ],
        (2, 2),
    )
    width, height = _png_size(out)
    assert width < height  # 2 rows (enc, cross at layer 1) of 2 heads, each panel square
    assert main([*argv, "--kind", "dec", "--heads", "1"]) == 0  # every layer, by default
    assert _panel_grid(calls[-1][1]) == (
        ["decoder self-attention, layer 0, head 1", "decoder self-attention, layer 1, head 1"],
        (2, 1),
    )
    capsys.readouterr()

    assert main([*argv, "--layers", "3"]) == 1
    err = capsys.readouterr().err
    assert "aiayn attention: error:" in err and "0 to 1" in err
    with pytest.raises(SystemExit):
        main([*argv, "--kind", "enc,self"])
    assert "choose from enc,dec,cross" in capsys.readouterr().err


def test_attention_command_max_len_limits_the_decoding(model_dir, maps, tmp_path, monkeypatch, capsys):
    """The untrained model produces no EOS within 6 tokens (``maps``), so the limit decides the rows."""
    drawn, plot_attention = [], viz.plot_attention
    monkeypatch.setattr(viz, "plot_attention", lambda maps, **kw: drawn.append(maps) or plot_attention(maps, **kw))
    argv = ["attention", "--model", str(model_dir), SENTENCE, "--out", str(tmp_path / "maps.png"), "--kind", "dec"]
    assert main([*argv, "--max-len", "3"]) == 0
    assert drawn[-1].target == maps.target[:3]  # <s> and 2 tokens; the 3rd output token is the forced EOS
    assert main(argv) == 0
    assert len(drawn[-1].target) > 6  # by default up to the source length + 50
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit):
            main([*argv, "--max-len", bad])
        assert "not a positive integer" in capsys.readouterr().err


def test_plot_run_is_one_png_and_leaves_the_backend_alone(tmp_path, monkeypatch):
    import matplotlib

    monkeypatch.setitem(matplotlib.rcParams, "backend", "svg")  # the user's choice
    train = [{"kind": "train", "step": s, "loss": 5 / s, "lr": 1e-3 * min(s**-0.5, s / 4**1.5)} for s in range(1, 9)]
    dev = [{"kind": "dev", "step": s, "loss": 4 / s, "ppl": math.exp(4 / s)} for s in (4, 8)]
    final = [{"kind": "final", "step": 8, "dev_loss": 0.5, "dev_ppl": 1.65, "dev_bleu": 12.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train + dev + final))
    out = viz.plot_run(tmp_path)
    assert out == tmp_path / "curves.png" and _png_size(out) == (1500, 400)
    assert matplotlib.rcParams["backend"] == "svg"


def test_a_paired_runs_plot_adds_its_member_and_the_two_together(tmp_path):
    """A run of train.members: the other member's dev perplexity beside member 1's, and the
    ensemble's dev perplexity and greedy BLEU at the end (metrics.jsonl's ``ensemble`` record)."""
    dev = [{"kind": "dev", "step": s, "loss": 4 / s, "ppl": math.exp(4 / s)} for s in (4, 8)]
    final = [{"kind": "final", "step": 9, "dev_loss": 0.5, "dev_ppl": 1.65, "dev_bleu": 12.5}]
    together = [{"kind": "ensemble", "members": 2, "dev_loss": 0.4, "dev_ppl": 1.5, "dev_bleu": 14.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dev + final + together))
    (tmp_path / "member2").mkdir()
    theirs = [{"kind": "dev", "step": s, "loss": 5 / s, "ppl": math.exp(5 / s)} for s in (4, 8)]
    (tmp_path / "member2" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in theirs))
    fig = viz.run_figure(tmp_path)
    ppl, bleu = fig.axes[2], fig.axes[-1]
    lines = {line.get_label(): line.get_data() for line in ppl.get_lines()}
    assert list(lines) == ["dev perplexity, member 1", "member2", "the 2 together"]
    assert list(lines["member2"][1]) == pytest.approx([math.exp(5 / 4), math.exp(5 / 8)])
    assert list(lines["the 2 together"][0]) == [9] and list(lines["the 2 together"][1]) == [1.5]
    labels = [line.get_label() for line in bleu.get_lines()]
    assert labels == ["greedy dev BLEU 12.5, member 1", "greedy dev BLEU 14.0, together"]


def test_plot_runs_draws_each_runs_dev_perplexity(tmp_path, capsys):
    runs = []
    for name, scale in (("a", 4.0), ("b", 3.0)):
        run = tmp_path / name
        run.mkdir()
        dev = [{"kind": "dev", "step": s, "loss": scale / s, "ppl": math.exp(scale / s)} for s in (4, 8, 12)]
        final = [{"kind": "final", "step": 12, "dev_bleu": scale * 2}] if name == "b" else []
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dev + final))
        runs.append(run)
    fig = viz.plot_runs(runs)
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["a", "b (greedy dev BLEU 6.00)"]
    for line, scale in zip(lines, (4.0, 3.0), strict=True):
        steps, ppl = line.get_data()
        assert list(steps) == [4, 8, 12] and ppl == pytest.approx([math.exp(scale / s) for s in (4, 8, 12)])
    out = tmp_path / "runs.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "--out", str(out)]) == 0
    assert _png_size(out) == (800, 500) and f"written {out}" in capsys.readouterr().out


def test_dev_bleu_over_minutes_is_drawn_from_the_runs_records(tmp_path):
    """With ``train.bleu_every`` records, plot_run adds a panel and plot_runs a second one: dev
    BLEU against minutes of training, the final evaluation included, in time order."""
    dev = [{"kind": "dev", "step": s, "loss": 4 / s, "ppl": math.exp(4 / s)} for s in (4, 8)]
    scored = [{"kind": "dev_bleu", "step": s, "bleu": b, "chrf": 2 * b, "elapsed": t}
              for s, b, t in ((4, 3.0, 120.0), (8, 5.5, 270.0))]  # fmt: skip
    final = [{"kind": "final", "step": 10, "dev_bleu": 6.25, "dev_ppl": 9.0, "elapsed": 330.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in final + dev + scored))
    out = viz.plot_run(tmp_path)
    assert _png_size(out) == (2000, 400)
    fig = viz.plot_runs([tmp_path])
    (line,) = fig.axes[1].get_lines()
    minutes, bleu = line.get_data()
    assert list(minutes) == pytest.approx([2.0, 4.5, 5.5]) and list(bleu) == [3.0, 5.5, 6.25]
    assert fig.axes[1].get_xlabel().startswith("minutes")


def test_plot_pe_and_lr_commands(tmp_path, capsys, monkeypatch):
    pe_calls, lr_calls = _spy(monkeypatch, "plot_positional_encoding"), _spy(monkeypatch, "plot_schedule")
    pe, lr = tmp_path / "pe.png", tmp_path / "lr.png"
    assert main(["plot", "pe", "--length", "20", "--d-model", "8", "--out", str(pe)]) == 0
    _assert_positional_encoding(pe_calls[-1][1], 20, 8)
    ding = Path(__file__).parents[1] / "configs" / "ding.yaml"
    assert main(["plot", "lr", "--config", str(ding), "--out", str(lr)]) == 0
    assert capsys.readouterr().out == f"written {pe}\nwritten {lr}\n"
    assert _png_size(pe) == (800, 600) and _png_size(lr) == (800, 450)
    # the curve is §5.3's formula with the preset's d_model, warmup and scale, read here from the YAML,
    # annealed linearly to 0 over the preset's cooldown, the last fraction of the steps drawn
    preset = yaml.safe_load(ding.read_text())
    d_model, warmup, scale = preset["model"]["d_model"], preset["train"]["warmup"], preset["train"]["lr_scale"]
    cooldown = preset["train"]["cooldown"]
    assert d_model != 512 and warmup != 4000 and scale != 1.0 and cooldown > 0  # none the default: ignoring one shows
    assert "max_steps" not in preset["train"]
    steps, rates = lr_calls[-1][1].axes[0].lines[0].get_data()
    n = 10 * warmup
    assert list(steps) == list(range(1, n + 1))  # without max_steps: 10 · warmup steps
    expected = [
        scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5) * min(1, (n - step + 1) / (cooldown * n))
        for step in steps
    ]
    assert list(rates) == pytest.approx(expected, rel=1e-9)
    # a flag of the other kind is an error, not silently ignored
    assert main(["plot", "pe", "--steps", "10", "--out", str(pe)]) == 1
    assert "--steps belongs to `aiayn plot lr`" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "no-run"), "--length", "10"]) == 1
    assert "--length belongs to `aiayn plot pe`" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "no-run")]) == 1  # a run directory, still
    assert "metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # not silently the default range
        main(["plot", "lr", "--steps", "0", "--out", str(lr)])
    assert exit_info.value.code == 2 and "'0' is not a positive integer" in capsys.readouterr().err


def test_plot_help_explains_the_reserved_words(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plot", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "aiayn plot RUN_DIR" in help_text and "aiayn plot pe" in help_text and "aiayn plot lr" in help_text
    assert "reserved" in help_text
