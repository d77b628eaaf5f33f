"""Megatron-LM's ``megatron.core.package_info`` names, which third-party converters import (version checks)."""
from megatron import __version__ as _version

MAJOR, MINOR, PATCH = (int(x) for x in _version.split(".")[:3])
PRE_RELEASE = ""
VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
__shortversion__ = ".".join(map(str, VERSION[:3]))
__version__ = __shortversion__ + PRE_RELEASE
__package_name__ = "megatron_core"
__contact_names__ = "Megatron-DeepSpeed-style framework maintainers"
__description__ = "Megatron-LM compatible training framework (this repository)"
__license__ = "BSD-3"
