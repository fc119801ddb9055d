"""pip install ./python builds with the in-tree backend alone (_build.py):
the wheel holds the package, its py.typed and metadata, and imports."""

import os
import subprocess
import sys
import zipfile

HERE = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, HERE)
import _build  # noqa: E402


def test_wheel(tmp_path):
    assert _build.get_requires_for_build_wheel() == []
    name = _build.build_wheel(str(tmp_path))
    assert name == "dsec-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(tmp_path / name) as z:
        names = set(z.namelist())
        assert {"dsec/__init__.py", "dsec/aio.py", "dsec/client.py", "dsec/_wire.py", "dsec/py.typed",
                "dsec-0.1.0.dist-info/METADATA", "dsec-0.1.0.dist-info/WHEEL", "dsec-0.1.0.dist-info/RECORD"} <= names
        meta = z.read("dsec-0.1.0.dist-info/METADATA").decode()
        assert "Name: dsec\n" in meta and "Version: 0.1.0\n" in meta
        record = z.read("dsec-0.1.0.dist-info/RECORD").decode()
        assert all(n in record for n in names)
        site = tmp_path / "site"
        z.extractall(site)
    out = subprocess.run([sys.executable, "-c", "import dsec, dsec.aio; print(dsec.__version__)"], cwd=str(tmp_path),
                         env=dict(os.environ, PYTHONPATH=str(site)), check=True, capture_output=True, text=True).stdout
    assert out.strip() == "0.1.0"


def test_sdist(tmp_path):
    name = _build.build_sdist(str(tmp_path))
    assert name == "dsec-0.1.0.tar.gz" and (tmp_path / name).stat().st_size > 0
