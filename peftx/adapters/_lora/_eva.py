"""EVA (explained variance adaptation, PEFT's `init_lora_weights="eva"`): each adapted
layer's `lora_A` is the top right-singular vectors of the inputs it sees on a few batches,
found by incremental PCA, and the rank budget is spread over the layers by explained
variance. This module is the arithmetic on the inputs; `peftx.initialize_lora` collects
them from the model."""

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvaConfig:
    """PEFT's `EvaConfig`, the same fields and defaults.

    **Arguments:**

    - `rho`: a layer's rank may grow to `round(r · rho)` (`>= 1`; 1: no redistribution).
    - `tau`: a component has converged when its cosine similarity with the previous batch's
      is at least `tau` (in `[0, 1]`).
    - `use_label_mask`: leave out the tokens whose `labels` are `label_mask_value`.
    - `label_mask_value`: see `use_label_mask`.
    - `whiten`: divide each component by the square root of its singular value.
    - `adjust_scaling_factors`: a layer whose rank changes gets `lora_alpha` times
      `new_rank / r`, so that its scaling is the same.
    """

    rho: float = 2.0
    tau: float = 0.99
    use_label_mask: bool = True
    label_mask_value: int = -100
    whiten: bool = False
    adjust_scaling_factors: bool = True

    def __post_init__(self) -> None:
        for name, kind in (("rho", float), ("tau", float), ("label_mask_value", int)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | kind):
                raise TypeError(f"EvaConfig `{name}` must be a number; got {value!r}.")
        if not self.rho >= 1.0:
            raise ValueError(f"EvaConfig `rho` must be >= 1.0; got {self.rho!r}.")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"EvaConfig `tau` must be in [0, 1]; got {self.tau!r}.")

    @classmethod
    def of(cls, value: "EvaConfig | Mapping[str, Any] | None") -> "EvaConfig | None":
        """`value` as an `EvaConfig` (a dict as `adapter_config.json` holds it)."""
        if value is None or isinstance(value, EvaConfig):
            return value
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"eva_config has unknown keys {unknown}; known: {sorted(known)}.")
        return cls(**value)


class IncrementalPCA:
    """PEFT's `IncrementalPCA` (scikit-learn's algorithm) with an exact SVD of each
    update's small matrix (`n_components + tokens` rows) where PEFT draws a randomized one:
    the same components, deterministically."""

    def __init__(self, n_components: int):
        self.n_components = n_components
        self.components: np.ndarray | None = None

    def partial_fit(self, x: np.ndarray) -> None:
        x = x.astype(np.float32)
        n = x.shape[0]
        first = self.components is None
        if first:
            seen, mean, var = 0, np.zeros(x.shape[1]), np.zeros(x.shape[1])
        else:
            seen, mean, var = self.seen, self.mean, self.var
        total = seen + n
        new_sum = x.sum(0, dtype=np.float64)
        new_mean = new_sum / n
        centred = x - new_mean
        new_var = np.square(centred).sum(0, dtype=np.float64)
        new_var -= np.square(centred.sum(0, dtype=np.float64)) / n
        updated_mean = (mean * seen + new_sum) / total
        if first:
            updated_var = new_var / total
        else:
            ratio = seen / n
            last_sum = mean * seen
            unnormalized = var * seen + new_var + ratio / total * (last_sum / ratio - new_sum) ** 2
            updated_var = unnormalized / total
        if first:
            x = (x - updated_mean).astype(np.float32)
        else:  # in float64 from here, as torch promotes PEFT's stacked rows
            batch_mean = x.mean(0)
            correction = np.sqrt(seen / total * n) * (self.mean - batch_mean)
            x = np.vstack(
                [self.singular_values[:, None] * self.components, x - batch_mean, correction[None]]
            )
        _, s, vh = np.linalg.svd(x, full_matrices=False)
        # scikit-learn's sign rule: each component's largest entry positive
        vh = vh * np.sign(vh[np.arange(len(vh)), np.abs(vh).argmax(1)])[:, None]
        k = self.n_components
        self.components, self.singular_values = vh[:k], s[:k]
        self.explained_variance_ratio = (s**2 / np.sum(updated_var * total))[:k]
        self.seen, self.mean, self.var = total, updated_mean, updated_var


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    eps = 1e-8
    norms = np.maximum(np.linalg.norm(a, axis=1), eps) * np.maximum(np.linalg.norm(b, axis=1), eps)
    return (a * b).sum(1) / norms


def eva_components(
    layer_inputs: Callable[[Any], dict[str, np.ndarray]],
    batches: Sequence[Any],
    ranks: Mapping[str, int],
    config: EvaConfig,
    *,
    max_batches: int = 1000,
) -> dict[str, np.ndarray]:
    """PEFT's `get_eva_state_dict`: each layer's `lora_A` `(new_rank, in)`, `new_rank`
    possibly 0, the ranks summing to those of `ranks`.

    **Arguments:**

    - `layer_inputs`: a batch's inputs of each layer `(tokens, in)`, by layer name (the
      tokens kept, see `EvaConfig.use_label_mask`).
    - `batches`: the batches, cycled until every layer's components converge.
    - `ranks`: each layer's rank before EVA, by name, in the model's order.
    - `config`: the `EvaConfig`.
    - `max_batches`: an error after this many batches without convergence (PEFT has none).

    Layers that see the same inputs (a block's q, k and v) share one PCA, as in PEFT; the
    first of them gets the larger rank. Ties of explained variance go to the earlier layer.
    """
    first = layer_inputs(batches[0])
    for name, r in ranks.items():
        if round(r * config.rho) > first[name].shape[1]:
            raise ValueError(
                f"EVA gives {name} up to round(r * rho) = {round(r * config.rho)} components, "
                f"more than its {first[name].shape[1]} input features; lower r or eva_config.rho."
            )
    budget = sum(ranks.values())
    max_components = {name: round(r * config.rho) for name, r in ranks.items()}
    # layers whose inputs on the first batch are equal share the first one's PCA
    owner: dict[str, str] = {}
    seen: dict[bytes, str] = {}
    for name in ranks:
        digest = first[name].tobytes() + str(first[name].shape).encode()
        owner[name] = seen.setdefault(digest, name)
    for name in ranks:
        top = max(max_components[n] for n in ranks if owner[n] == owner[name])
        max_components[name] = top
    pcas = {name: IncrementalPCA(max_components[name]) for name in ranks if owner[name] == name}
    converged = {name: np.zeros(max_components[name], bool) for name in pcas}
    rank_dist = dict(max_components)
    done = dict.fromkeys(pcas, False)

    def cycled() -> Iterator[dict[str, np.ndarray]]:
        # PEFT reads the first batch twice: once to find equal inputs, then as the first
        # of the cycle
        yield first
        for i in itertools.count(1):
            yield first if i % len(batches) == 0 else layer_inputs(batches[i % len(batches)])

    for step, inputs in enumerate(cycled()):
        for name in pcas:
            done[name] = bool(converged[name][: rank_dist[name]].all())
        if all(done.values()):
            break
        if step == max_batches:
            raise ValueError(
                f"EVA's components did not converge in {max_batches} batches (tau="
                f"{config.tau}); give more varied batches, or a lower tau."
            )
        for name, pca in pcas.items():
            if done[name]:
                continue
            x = inputs[name]
            if x.shape[0] < pca.n_components:
                continue  # PEFT skips a batch with fewer tokens than components
            previous = pca.components
            pca.partial_fit(x)
            if previous is not None:
                converged[name] = _cosine(pca.components, previous) >= config.tau
        if all(p.components is not None for p in pcas.values()):
            rank_dist = _rank_distribution(pcas, owner, max_components, budget)
    out = {}
    for name, rank in rank_dist.items():
        pca = pcas[owner[name]]
        u = pca.components[:rank]
        if config.whiten:
            u = u / np.sqrt(pca.singular_values[:rank])[:, None]
        out[name] = u
    return out


def _rank_distribution(
    pcas: Mapping[str, IncrementalPCA],
    owner: Mapping[str, str],
    max_components: Mapping[str, int],
    budget: int,
) -> dict[str, int]:
    """PEFT's `_get_rank_distribution`: the `budget` largest explained-variance ratios over
    all layers (a shared PCA counted for each layer that shares it) give each its rank."""
    owners_first = sorted(owner, key=lambda n: owner[n] != n)  # PEFT's order of layers
    names, ratios = [], []
    for name in owners_first:
        r = pcas[owner[name]].explained_variance_ratio[: max_components[name]]
        names += [name] * len(r)
        ratios.append(r)
    order = np.argsort(-np.concatenate(ratios), kind="stable")[:budget]
    counts = dict.fromkeys(owner, 0)
    for i in order:
        counts[names[i]] += 1
    for name, first in owner.items():
        if name != first and counts[first] < counts[name]:
            counts[first], counts[name] = counts[name], counts[first]
    return counts
