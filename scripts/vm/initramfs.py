#!/usr/bin/env python3
"""Build the VM lane's initramfs for one kernel: static busybox, the init script and the
kernel modules the guest needs before it can see the host's root (with their dependencies, in
load order), as an uncompressed newc cpio archive.

    initramfs.py --modules DIR --busybox FILE --init FILE --cache DIR MODULE...

DIR is the kernel's module tree (lib/modules/<version>, after depmod). The archive is named
by the SHA-256 of everything in it and kept in the cache dir: a second run with the same
inputs finds it and builds nothing. Prints the archive's path.

Modules built into the kernel (modules.builtin) are skipped; a module that is neither built in
nor in modules.dep is an error. Compressed modules (.ko.xz, .ko.zst) are stored decompressed:
busybox's insmod hands the bytes to init_module(2) as they are.
"""

import argparse
import hashlib
import io
import lzma
import os
import sys
from pathlib import Path


def module_name(path):
    """`kernel/fs/9p/9p.ko.xz` -> `9p`; dashes and underscores are the same to the kernel."""
    base = Path(path).name.split(".ko")[0]
    return base.replace("-", "_")


def read_deps(tree):
    """modules.dep as {name: (relative path, [dependency paths])}, and the built-in names."""
    deps = {}
    for line in (tree / "modules.dep").read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[module_name(mod)] = (mod, rest.split())
    builtin = set()
    if (tree / "modules.builtin").exists():
        builtin = {module_name(l) for l in (tree / "modules.builtin").read_text().split()}
    return deps, builtin


def load_order(tree, wanted):
    """Module files in an order that loads every dependency before its user."""
    deps, builtin = read_deps(tree)
    order, seen = [], set()

    def visit(path):
        name = module_name(path)
        if name in seen:
            return
        seen.add(name)
        for d in deps[name][1]:
            visit(d)
        order.append(path)

    for w in wanted:
        name = w.replace("-", "_")
        if name in builtin:
            continue
        if name not in deps:
            sys.exit(f"initramfs.py: module {w} is neither built into {tree.name} nor in its modules.dep")
        visit(deps[name][0])
    return order


def module_bytes(path):
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".zst"):
        sys.exit(f"initramfs.py: {path}: zstd-compressed modules are not handled")
    return data


class Cpio:
    """A newc ("070701") archive, written in memory."""

    def __init__(self):
        self.out = io.BytesIO()
        self.ino = 1

    def _entry(self, name, mode, data=b""):
        name_b = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name_b), 0]
        self.ino += 1
        self.out.write(b"070701" + b"".join(b"%08X" % f for f in fields))
        self.out.write(name_b)
        self.out.write(b"\0" * (-(110 + len(name_b)) % 4))
        self.out.write(data)
        self.out.write(b"\0" * (-len(data) % 4))

    def dir(self, name):
        self._entry(name, 0o040755)

    def file(self, name, data, mode=0o644):
        self._entry(name, 0o100000 | mode, data)

    def finish(self):
        self._entry("TRAILER!!!", 0)
        return self.out.getvalue()


def build(tree, wanted, busybox, init):
    order = load_order(tree, wanted)
    a = Cpio()
    for d in ("bin", "dev", "modules", "proc", "sys"):
        a.dir(d)
    a.file("bin/busybox", busybox.read_bytes(), 0o755)
    a.file("init", init.read_bytes(), 0o755)
    names = []
    for rel in order:
        name = Path(rel).name.removesuffix(".xz")
        a.file(f"modules/{name}", module_bytes(tree / rel))
        names.append(name)
    a.file("modules/order", ("\n".join(names) + "\n").encode())
    return a.finish()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--modules", type=Path, required=True)
    p.add_argument("--busybox", type=Path, required=True)
    p.add_argument("--init", type=Path, required=True)
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("wanted", nargs="+")
    args = p.parse_args()
    data = build(args.modules, args.wanted, args.busybox, args.init)
    out = args.cache / f"initramfs-{hashlib.sha256(data).hexdigest()[:16]}.cpio"
    if not out.exists():
        args.cache.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.rename(out)
    print(out)


if __name__ == "__main__":
    main()
