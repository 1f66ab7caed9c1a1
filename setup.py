"""Builds the native core, ray_collective.native._core (a C11 extension over the CPython C API,
linked against nothing but libc); everything else about the package is in setup.cfg.

The extension is optional: where it cannot be built (no compiler, no Python headers) the install
still succeeds and ray_collective.native.available() says why it is missing.
"""

from setuptools import Extension, setup

NATIVE = "ray_collective/native/"

setup(ext_modules=[Extension(
    "ray_collective.native._core",
    sources=[NATIVE + name for name in ("module.c", "module_node.c", "module_program.c",
                                        "module_streams.c",
                                        "node.c", "progress.c", "executor.c", "program.c",
                                        "shm.c", "kernels.c", "remote.c", "streams.c",
                                        "digest.c")],
    depends=[NATIVE + name for name in ("module.h", "node.h", "shm.h", "kernels.h",
                                        "streams.h", "digest.h")],
    # No fused multiply-adds where numpy does not fuse either (kernels.c).
    extra_compile_args=["-std=c11", "-O3", "-ffp-contract=off", "-Wall",
                        "-Wno-unused-parameter"],
    optional=True,
)])
