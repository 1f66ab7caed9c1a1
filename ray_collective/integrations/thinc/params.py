"""A thinc model's parameters as every process of a run sees them, and as flat buffers.

thinc's own node ids count the models built in a process, so two workers' ids for the same
array can differ; every process agrees on a node's position in ``model.walk()`` instead, which
is the first half of a parameter's shared key (``KeyT``). A pipeline of several models (spaCy's
trainable components) is walked as one by giving it one holder model whose layers they are.

thinc routes every ``get_param`` / ``set_param`` / ``set_grad`` / ``inc_grad`` of a node through
its ``ParamServer``'s ``proxy`` once one is set (``install_proxy``): the private, experimental
hook spacy-ray was built on, and the one the parameter server and the per-array allreduce use.

``FlatBuffers`` lays every gradient (and, if asked, every parameter) of a model out as a view of
one flat float32 buffer, so that one collective moves them all: thinc adds gradients into the
views, and the optimizer updates parameters through them.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Tuple

import numpy as np

KeyT = Tuple[int, str]
"""A parameter's key shared by all workers: (its node's position in ``model.walk()``, name).
thinc's own node ids count models built in a process, so they can differ between processes."""



def parameter_nodes(model: Any) -> List[Tuple[int, Any]]:
    """The nodes that hold parameters, with their position in ``model.walk()``.

    Args:
        model: a thinc Model.

    Returns:
        ``(position, node)`` pairs in walk order.
    """
    return [(position, node) for position, node in enumerate(model.walk()) if node.param_names]


def install_proxy(model: Any, proxy: Any) -> None:
    """Route every node's ``ParamServer`` through ``proxy``, handing it the current parameters.

    thinc's ``ParamServer`` calls ``proxy.get_param / set_param / set_grad / inc_grad`` once a
    proxy is set: the hook spacy-ray was built on (the attribute is private and experimental).

    Args:
        model: a thinc Model.
        proxy: an object with those four methods, taking ``(model_id, name[, value])``.
    """
    for _, node in parameter_nodes(model):
        node._params.proxy = None
        for name in node.param_names:
            proxy.set_param(node.id, name, node.get_param(name))
    for node in model.walk():
        node._params.proxy = proxy


def parameter_keys(model: Any) -> List[KeyT]:
    """Every parameter's shared key, in walk order.

    Args:
        model: a thinc Model.

    Returns:
        The keys.
    """
    return [(position, name) for position, node in parameter_nodes(model)
            for name in node.param_names]


def key_of_node(model: Any) -> Dict[int, int]:
    """thinc's node id -> the node's position in the walk (the first half of a ``KeyT``).

    Args:
        model: a thinc Model.

    Returns:
        The mapping.
    """
    return {node.id: position for position, node in parameter_nodes(model)}


def parameter_count(model: Any) -> int:
    """The number of parameters (floats) of the model.

    Args:
        model: a thinc Model.

    Returns:
        The count.
    """
    return sum(node.get_param(name).size for _, node in parameter_nodes(model)
               for name in node.param_names)


def parameter_vector(model: Any) -> np.ndarray:
    """Every parameter of the model, concatenated in walk order (a copy, on the host).

    Args:
        model: a thinc Model.

    Returns:
        A float32 vector.
    """
    ops = model.ops
    return np.concatenate([ops.to_numpy(node.get_param(name)).ravel()
                           for _, node in parameter_nodes(model) for name in node.param_names])


def parameter_digest(model: Any) -> str:
    """A hash of ``parameter_vector``: equal on two workers only if their weights are bitwise so.

    Args:
        model: a thinc Model.

    Returns:
        Hex SHA-256.
    """
    return hashlib.sha256(parameter_vector(model).tobytes()).hexdigest()


class FlatBuffers:
    """Flat float32 buffers whose views are the model's gradients (and, if asked, parameters).

    Both are padded with zeros to a multiple of ``world_size`` so that they split in equal parts.
    """

    def __init__(self, model: Any, world_size: int, parameters_too: bool) -> None:
        arrays = [(node, name, node.get_param(name)) for _, node in parameter_nodes(model)
                  for name in node.param_names]
        size = sum(array.size for _, _, array in arrays)
        padded = -(-size // world_size) * world_size
        xp = model.ops.xp
        self.grads = xp.zeros(padded, dtype=xp.float32)
        self.params = xp.zeros(padded, dtype=xp.float32) if parameters_too else None
        offset = 0
        for node, name, array in arrays:
            window = slice(offset, offset + array.size)
            node.set_grad(name, self.grads[window].reshape(array.shape))
            if self.params is not None:
                self.params[window] = array.ravel()
                node.set_param(name, self.params[window].reshape(array.shape))
            offset += array.size

