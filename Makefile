# aiayn: `make demo` (the main job) and `make test` (the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
AIAYN := $(VENV)/bin/aiayn
TORCH_VERSION ?= 2.13.0
# PyTorch's CPU wheels (~200 MB; PyPI's Linux wheel pulls the CUDA libraries, gigabytes), used where
# the index answers within 5 s; `make TORCH_INDEX=` takes pip's own sources only. With both, pip
# picks the index's 2.13.0+cpu over PyPI's 2.13.0 (a local version sorts higher; checked against
# PyPI with a local copy of the index: no nvidia packages installed)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
DING := /usr/share/trans/de-en
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

.PHONY: install ding browser demo ensemble test lint bench clean copy-demo

install: $(VENV)/.installed

# torch first, pinned, so that pip never resolves a newer one, and its CPU build where PyTorch's
# index can be reached; then the project.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	if [ -n "$(TORCH_INDEX)" ] && $(PY) -c "import urllib.request; urllib.request.urlopen('$(TORCH_INDEX)/', timeout=5)" 2>/dev/null; then \
		$(PY) -m pip install --quiet --extra-index-url "$(TORCH_INDEX)" "torch==$(TORCH_VERSION)"; \
	else \
		$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# The Ding dictionary (Debian package trans-de-en, GPL-2+). Without apt or root, aiayn looks at
# $$AIAYN_DING_PATH or downloads the upstream file into ~/.cache/aiayn.
ding:
	@if [ ! -f $(DING) ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -qq trans-de-en || (apt-get update -qq && apt-get install -y -qq trans-de-en)) >/dev/null; \
	fi

# Headless Chromium for the explorer's browser test (tests/test_explorer.py, skipped without it),
# installed where apt and root are at hand, as the dictionary is.
browser:
	@if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -qq chromium || (apt-get update -qq && apt-get install -y -qq chromium)) >/dev/null; \
	fi

data/ding/train.de: | install ding
	$(AIAYN) data ding --out data/ding

# The main job: a German->English translator trained from scratch on this CPU (about 17 minutes).
# Its test split is scored with alpha 2.0, not the paper's 0.6: chosen on the dev split with the
# kNN-MT datastores (train.knn) over 4 pairs of this preset (docs/benchmarks.md, "kNN-MT"; 1.5
# before them, over 7 models of the 3 + 3-layer presets).
demo: install ding data/ding/train.de
	rm -rf runs/ding  # the demo always trains from scratch
	$(AIAYN) train --config configs/ding.yaml --out runs/ding
	$(AIAYN) evaluate --model runs/ding/model --src data/ding/test.de --ref data/ding/test.en --alpha 2.0 --samples 8
	$(AIAYN) plot runs/ding

# More time, after `make demo`: SEEDS more runs of its preset, each reading and writing with the
# demo's tokenizer (about 15 minutes each; two models at once where the demo pairs, train.members),
# then the test split scored by all of their models as one ensemble, the mean of their
# probabilities (docs/benchmarks.md, "Ensembles"). ENSEMBLE_ARGS go to each training run (e.g.
# --train.max_time 1680).
SEEDS ?= 2 3
ENSEMBLE_ARGS ?=
ensemble: install data/ding/train.de
	@test -f runs/ding/model/tokenizer.json || { echo "make ensemble adds to the demo's model: run make demo first" >&2; exit 1; }
	for s in $(SEEDS); do \
		rm -rf runs/ding-seed$$s && \
		$(AIAYN) train --config configs/ding.yaml --out runs/ding-seed$$s --train.seed $$s --train.tokenizer runs/ding/model $(ENSEMBLE_ARGS) || exit 1; \
	done
	$(AIAYN) evaluate --model runs/ding/model $(foreach s,$(SEEDS),--model runs/ding-seed$(s)/model) --src data/ding/test.de --ref data/ding/test.en --alpha 1.5 --samples 8

copy-demo: install
	$(AIAYN) copy-task

test: install ding browser
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check src tests bench

bench: install
	$(PY) bench/model_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
