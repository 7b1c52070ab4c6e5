"""Nearest-neighbour translation (not in the paper; kNN-MT, Khandelwal et al., 2021, "Nearest
Neighbor Machine Translation", ICLR): a trained model's memory of its own training data, read at
decoding time.

A *datastore* holds, for every target position of the training pairs, the decoder's output
state there under teacher forcing (the ``d_model`` vector the pre-softmax projection of §3.4
reads; the key) and the token that came next (the value). At each decoding step the current
state queries it for its ``k`` nearest keys (squared L2 distance d), and the next-token
distribution becomes

    p(y | x, y<t) = λ p_kNN(y) + (1 - λ) p_model(y | x, y<t),
    p_kNN(y) ∝ Σ_{(key, value) in the k nearest, value = y} exp(-d(key, state) / T).

Nothing is trained; the model's parameters are unchanged. The search is faiss's (an exact one
for small stores, an inverted file of ``nlist ≈ 2 √N`` lists probed ``nprobe`` at a time above
``FLAT_BELOW`` keys). Decoding on the engine (``aiayn.engine.prepare``) applies a store given to
``prepare``; ``Translator.from_pretrained`` loads the one saved in a model directory
(``datastore.safetensors``, with the ``RetrievalConfig`` in its metadata: no pickle), which
``train.knn`` writes at the end of a run. The defaults (k 16, T 10, λ 0.3) were chosen on the Ding
dev split (docs/benchmarks.md, "kNN-MT").
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from .data.batching import TokenBatcher, collate
from .model import Transformer
from .model.pretrained import atomic_write

__all__ = ["DATASTORE_NAME", "FLAT_BELOW", "RetrievalConfig", "Datastore"]

DATASTORE_NAME = "datastore.safetensors"
FLAT_BELOW = 50_000  # keys: fewer are searched exactly (faiss IndexFlatL2)


@dataclass(frozen=True)
class RetrievalConfig:
    """How a datastore is read: ``k`` neighbours, temperature ``T`` on the squared distances,
    ``lam`` (λ) the weight of the neighbours' distribution, ``nprobe`` inverted lists searched."""

    k: int = 16
    temperature: float = 10.0
    lam: float = 0.3
    nprobe: int = 32

    def __post_init__(self) -> None:
        if self.k < 1 or self.nprobe < 1:
            raise ValueError(f"k and nprobe must be >= 1, got k={self.k}, nprobe={self.nprobe}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam (λ) must be in [0, 1], got {self.lam}")

    def replace(self, **changes: Any) -> RetrievalConfig:
        return RetrievalConfig(**{**asdict(self), **changes})


def _faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise ImportError("kNN-MT searches with faiss: pip install faiss-cpu") from None
    return faiss


class Datastore:
    """Keys ``(N, d_model)`` (float32) and values ``(N,)`` (token ids) of a model's training
    targets, and the ``RetrievalConfig`` to read them with (module docstring)."""

    def __init__(
        self, keys: Tensor, values: Tensor, config: RetrievalConfig | None = None, centroids: Tensor | None = None
    ) -> None:
        if keys.dim() != 2 or values.dim() != 1 or keys.size(0) != values.size(0) or keys.size(0) == 0:
            raise ValueError(f"a datastore needs keys (N, d) and values (N,), N > 0; got {tuple(keys.shape)}, "
                             f"{tuple(values.shape)}")  # fmt: skip
        self.keys = keys.half().float().contiguous()  # as saved: a store searches the same keys before and after
        self.values = values.long()
        self.config = RetrievalConfig() if config is None else config
        self.centroids = centroids  # (nlist, d_model): the inverted file's lists, once trained (saved with the store)
        self._index: Any = None

    def with_config(self, config: RetrievalConfig) -> Datastore:
        """This store (its keys, values, lists and index, shared, not copied) read with ``config``."""
        _ = self.index  # built here once, if not yet (an inverted file's lists with it)
        store = copy.copy(self)
        store.config = config
        return store

    def __len__(self) -> int:
        return self.keys.size(0)

    @property
    def index(self) -> Any:
        """The faiss index over the keys, built at first use: exact below ``FLAT_BELOW`` keys, else
        an inverted file whose lists are ``centroids``, found here by k-means (seeded) where the
        store came without them."""
        if self._index is None:
            faiss = _faiss()
            faiss.omp_set_num_threads(torch.get_num_threads())
            N, d = self.keys.shape
            keys = self.keys.numpy()
            if N < FLAT_BELOW:
                index = faiss.IndexFlatL2(d)
            else:
                if self.centroids is None:
                    kmeans = faiss.Kmeans(d, round(2 * math.sqrt(N)), niter=10, seed=1234, max_points_per_centroid=64)
                    kmeans.train(keys)
                    self.centroids = torch.from_numpy(kmeans.centroids.copy())
                quantizer = faiss.IndexFlatL2(d)
                quantizer.add(self.centroids.float().numpy())
                index = faiss.IndexIVFFlat(quantizer, d, self.centroids.size(0))
                index.train(keys[:1])  # nothing to learn: its quantizer holds the lists already
            index.add(keys)
            self._index = index
        return self._index

    def search(self, queries: Tensor) -> tuple[Tensor, Tensor]:
        """The ``k`` nearest keys of each query ``(R, d_model)``: squared distances ``(R, k)`` and
        key indices ``(R, k)``, nearest first; -1 (distance inf) where fewer than k were found."""
        faiss, index = _faiss(), self.index
        faiss.omp_set_num_threads(torch.get_num_threads())
        if hasattr(index, "nprobe"):
            index.nprobe = self.config.nprobe
        k = min(self.config.k, len(self))
        distances, ids = index.search(queries.detach().float().cpu().contiguous().numpy(), k)
        distances, ids = torch.from_numpy(distances), torch.from_numpy(ids)
        return distances.masked_fill(ids < 0, math.inf), ids

    def mix(self, hidden: Tensor, logits: Tensor) -> Tensor:
        """log(λ p_kNN + (1 - λ) softmax(logits)) ``(R, V)``, float32, for decoder states
        ``hidden`` ``(R, d_model)`` and the model's ``logits`` ``(R, V)`` at them."""
        cfg = self.config
        p = torch.softmax(logits.reshape(hidden.size(0), -1).float(), dim=-1)  # (R, V)
        if cfg.lam > 0:
            distances, ids = self.search(hidden)  # (R, k)
            weights = torch.softmax(-distances / cfg.temperature, dim=-1).nan_to_num(0.0)  # (R, k); not found: 0
            tokens = self.values[ids.clamp_min(0)]  # (R, k)
            p_knn = torch.zeros_like(p).scatter_add_(1, tokens.to(p.device), weights.to(p.device))
            lam = cfg.lam * (ids >= 0).any(dim=-1, keepdim=True).to(p)  # (R, 1): a row no list held keeps p
            p = lam * p_knn + (1 - lam) * p
        return p.clamp_min(torch.finfo(p.dtype).tiny).log()

    @classmethod
    @torch.inference_mode()
    def build(
        cls,
        model: Transformer,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        config: RetrievalConfig | None = None,
        max_tokens: int = 4096,
    ) -> Datastore:
        """The datastore of ``model`` (in eval mode, teacher forced) over ``pairs`` of source and
        target ids (no BOS/EOS): a key per target token and the EOS after it."""
        if not pairs:
            raise ValueError("a datastore needs at least one pair")
        was_training = model.training
        model.eval()
        c = model.config
        device = next(model.parameters()).device
        keys, values = [], []
        lengths = [(len(s) + 1, len(t) + 1) for s, t in pairs]
        try:
            for batch in TokenBatcher(lengths, max_tokens, shuffle=False, long_alone=True).batches:
                b = collate([pairs[i] for i in batch], c.pad_id, c.bos_id, c.eos_id)
                select = b.tgt_out != c.pad_id  # (B, T)
                enc = model.encode(b.src.to(device))
                out = model.decode(b.tgt_in.to(device), enc.memory, enc.mask, select=select.to(device))
                keys.append(out.hidden.float().cpu())  # (N_b, d_model)
                values.append(b.tgt_out[select])  # (N_b,)
        finally:
            model.train(was_training)
        return cls(torch.cat(keys), torch.cat(values), config)

    def save(self, directory: str | Path) -> Path:
        """Write ``datastore.safetensors`` into ``directory`` (keys as float16, values as int32,
        an inverted file's lists, the config as metadata), atomically."""
        path = Path(directory) / DATASTORE_NAME
        _ = self.index  # an inverted file's lists: found once, here, not at each load
        tensors = {"keys": self.keys.half(), "values": self.values.int()}
        if self.centroids is not None:
            tensors["centroids"] = self.centroids.float().contiguous()
        metadata = {"retrieval": json.dumps(asdict(self.config))}
        atomic_write(path, lambda tmp: safetensors.torch.save_file(tensors, tmp, metadata=metadata))
        return path

    @classmethod
    def load(cls, directory: str | Path, **changes: Any) -> Datastore | None:
        """The datastore saved in ``directory`` (None: there is none); ``changes`` override its
        config (e.g. ``lam=0.5``). An unreadable file is an error naming it."""
        path = Path(directory) / DATASTORE_NAME
        if not path.exists():
            return None
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                keys, values = f.get_tensor("keys"), f.get_tensor("values")
                centroids = f.get_tensor("centroids") if "centroids" in f.keys() else None  # noqa: SIM118 (safe_open has no __contains__)
            known = {f.name for f in fields(RetrievalConfig)}
            stored = RetrievalConfig(
                **{k: v for k, v in json.loads(metadata.get("retrieval", "{}")).items() if k in known}
            )
            store = cls(keys, values, stored, centroids)
        except (safetensors.SafetensorError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a readable datastore: {e}") from None
        store.config = stored.replace(**{k: v for k, v in changes.items() if v is not None})
        return store
