"""An in-tree PEP 517 build backend, standard library only, so that
``pip install ./python`` works offline: nothing (setuptools, wheel) has to be
fetched to build this pure-Python package. It builds a py3-none-any wheel of
dsec/ and an sdist of this directory; name, version and summary come from
pyproject.toml's [project] table."""

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _project():
    with open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("[project]", 1)[1].split("\n[", 1)[0]
    out = {}
    for key in ("name", "version", "description", "requires-python"):
        m = re.search(r'^%s\s*=\s*"([^"]*)"' % re.escape(key), table, re.M)
        if m:
            out[key] = m.group(1)
    return out


def _metadata():
    p = _project()
    lines = ["Metadata-Version: 2.1", "Name: " + p["name"], "Version: " + p["version"], "Summary: " + p.get("description", "")]
    if "requires-python" in p:
        lines.append("Requires-Python: " + p["requires-python"])
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        lines += ["Description-Content-Type: text/markdown", "", f.read()]
    return "\n".join(lines) + "\n"


def _files():
    for f in sorted(os.listdir(os.path.join(HERE, "dsec"))):
        if f.endswith(".py") or f == "py.typed":
            yield "dsec/" + f


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    p = _project()
    name = "%s-%s-py3-none-any.whl" % (p["name"], p["version"])
    info = "%s-%s.dist-info/" % (p["name"], p["version"])
    records = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        def add(arc, data):
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append("%s,sha256=%s,%d" % (arc, digest, len(data)))

        for arc in _files():
            with open(os.path.join(HERE, arc), "rb") as f:
                add(arc, f.read())
        add(info + "METADATA", _metadata().encode())
        add(info + "WHEEL", b"Wheel-Version: 1.0\nGenerator: dsec _build\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        records.append(info + "RECORD,,")
        z.writestr(info + "RECORD", "\n".join(records) + "\n")
    return name


def build_sdist(sdist_directory, config_settings=None):
    p = _project()
    base = "%s-%s" % (p["name"], p["version"])
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        for arc in ["pyproject.toml", "README.md", "_build.py"] + list(_files()):
            t.add(os.path.join(HERE, arc), base + "/" + arc)
        data = _metadata().encode()
        ti = tarfile.TarInfo(base + "/PKG-INFO")
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
    return name
