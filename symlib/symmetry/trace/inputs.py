"""What the dummy input that traces a network must be (book: chapter "Transformers: permutations without
scalings"): token ids for a network that looks them up in an embedding, at most as many distinct ids as the
embedding has rows (:func:`check_vocab`), and, when neither ``torch.fx`` nor ``torch.export`` reads a model,
the advice its error calls for (:func:`advice`: a float input to an embedding, a decoder's key/value cache).
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from symlib.symmetry.spec import SymmetryError

__all__ = ["advice", "check_vocab"]


def check_vocab(gm: torch.fx.GraphModule, vocab: int) -> None:
    """Refuse a ``vocab`` larger than the rows of an embedding that looks up the token ids (the graph's
    input, or integer tensors computed from it: a view, a reshape): the functional checks would draw ids it
    cannot look up."""
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}

    def reads_ids(node, seen=None) -> bool:  # an integer tensor computed from the input's values
        seen = set() if seen is None else seen
        if node in inputs:
            return True
        meta = getattr(node, "meta", {}).get("tensor_meta") if isinstance(node, torch.fx.Node) else None
        if meta is None or not hasattr(meta, "dtype") or meta.dtype.is_floating_point or node in seen:
            return False
        seen.add(node)
        return any(reads_ids(a, seen) for a in node.all_input_nodes)

    for node in gm.graph.nodes:
        table = None
        if node.op == "call_module" and node.args and isinstance(node.args[0], torch.fx.Node) \
                and reads_ids(node.args[0]):
            mod = gm.get_submodule(node.target)
            table = (node.target, mod.num_embeddings) if isinstance(mod, nn.Embedding) else None
        elif node.op == "call_function" and "embedding" in getattr(node.target, "__name__", str(node.target)):
            first, second = node.args[0], node.args[1]
            ids, weight = (first, second) if reads_ids(first) else (second, first)
            meta = getattr(weight, "meta", {}).get("tensor_meta") if reads_ids(ids) else None
            table = (weight.name, int(meta.shape[0])) if meta is not None else None
        if table is not None and vocab > table[1]:
            raise SymmetryError(f"vocab={vocab} is larger than the {table[1]} rows of the embedding "
                                f"{table[0]!r} that reads the token ids; pass vocab={table[1]} (the "
                                f"tokenizer's vocabulary size, at most the embedding's rows)")


def advice(model: nn.Module, dummy: torch.Tensor, error: str) -> str:
    """What to do when neither ``torch.fx`` nor ``torch.export`` reads ``model``, from the export's error."""
    tables = [name for name, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if dummy.is_floating_point() and tables and ("indices" in error or "Long" in error):
        return (f"The network reads token ids (its embedding {tables[0]!r} looks them up) and the dummy "
                f"input was a float tensor: pass vocab=N (--vocab N; a Hugging Face config.json's vocab_size "
                f"is read when present), with the input shape (TOKENS,)")
    if "Cache" in error:
        return ("The model returns a key/value cache (a Hugging Face decoder with use_cache=True): set "
                "model.config.use_cache = False before tracing")
    return "Remove data-dependent control flow from forward, or write the Spec by hand"
