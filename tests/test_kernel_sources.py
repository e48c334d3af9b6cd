"""Kernel sources: a kernel's #include lines resolve into its header (each lib file once, after
the files it includes), and the header keeps only the whole definitions its body uses."""

import pytest

from muser_mlx import kernels

BASE = """\
// A helper with a blank line inside, a comment with a brace } and a portable branch.
inline float muser_twice(float x) {
  float y = x;

  return y + x;  // }
}

#if defined(__CUDACC__)
inline uint muser_shim(uint x) {
  return x;
}
#else
inline uint muser_shim(uint x) {

  return x + 0u;
}
#endif

inline float muser_unused(float x) {
  return x;
}
"""


@pytest.fixture
def lib(tmp_path, monkeypatch):
    """A kernels/ directory of the test's own lib files: lib(name=text, ...)."""
    monkeypatch.setattr(kernels, "kernel_dir", lambda: tmp_path)
    (tmp_path / "lib").mkdir()

    def write(**files):
        for name, text in files.items():
            (tmp_path / "lib" / f"{name}.metal").write_text(text)

    return write


def probe(text):
    return kernels.kernel_source("probe", ("x",), ("out",), text)


def test_a_helper_with_a_blank_line_inside_is_kept_whole(lib):
    lib(base=BASE)
    kernel = probe('#include "lib/base.metal"\nout[0] = muser_twice(x[0]) + float(muser_shim(1u));\n')
    assert kernel.header == ("inline float muser_twice(float x){\nfloat y=x;\nreturn y+x;\n}\n"
                             "#if defined(__CUDACC__)\ninline uint muser_shim(uint x){\nreturn x;\n}\n#else\n"
                             "inline uint muser_shim(uint x){\nreturn x+0u;\n}\n#endif\n")
    assert "muser_unused" not in kernel.header and "#include" not in kernel.body


def test_each_lib_file_appears_once_after_the_files_it_includes(lib):
    lib(base="#define MUSER_ONE 1\n",
        left='#include "lib/base.metal"\ninline int muser_left() {\n  return MUSER_ONE;\n}\n',
        right='#include "lib/base.metal"\n#include "lib/left.metal"\ninline int muser_right() {\n'
              "  return muser_left() + MUSER_ONE;\n}\n")
    kernel = probe('#include "lib/right.metal"\n#include "lib/left.metal"\nout[0] = float(muser_right());\n')
    assert kernel.header == "#define MUSER_ONE 1\ninline int muser_left(){\nreturn MUSER_ONE;\n}\n" \
                            "inline int muser_right(){\nreturn muser_left()+MUSER_ONE;\n}\n"
    text = '#include "lib/right.metal"\n'
    assert kernels._included_files(text, "probe") == ["lib/base.metal", "lib/left.metal", "lib/right.metal"]


def test_an_unknown_include_names_the_file_and_its_includer(lib):
    lib(base='#include "lib/missing.metal"\n')
    with pytest.raises(kernels.KernelSourceError, match=r"kernel probe: #include \"lib/absent.metal\": no file"):
        probe('#include "lib/absent.metal"\nout[0] = x[0];\n')
    with pytest.raises(kernels.KernelSourceError, match=r"lib/base.metal: #include \"lib/missing.metal\""):
        probe('#include "lib/base.metal"\nout[0] = x[0];\n')


def test_an_include_cycle_is_refused(lib):
    lib(a='#include "lib/b.metal"\n', b='#include "lib/a.metal"\n')
    with pytest.raises(kernels.KernelSourceError,
                       match="include cycle: kernel probe -> lib/a.metal -> lib/b.metal -> lib/a.metal"):
        probe('#include "lib/a.metal"\nout[0] = x[0];\n')


@pytest.mark.parametrize("line", ["#include <metal_stdlib>", '#include "base.metal"', '#include "lib/../product.metal"'])
def test_kernels_include_lib_files_only(lib, line):
    with pytest.raises(kernels.KernelSourceError, match="include lib files only"):
        probe(f"{line}\nout[0] = x[0];\n")


def test_unbalanced_helper_code_is_refused(lib):
    lib(base="inline float muser_open(float x) {\n  return x;\n")
    with pytest.raises(kernels.KernelSourceError, match="ends inside a definition"):
        probe('#include "lib/base.metal"\nout[0] = muser_open(x[0]);\n')


def test_kernel_names_are_the_kernels_not_the_lib_files():
    names = kernels.kernel_names()
    assert "product" in names and "embedding" in names
    assert not {"base", "formats", "q8x", "attention"} & set(names)
    assert {p.stem for p in (kernels.kernel_dir() / "lib").glob("*.metal")} >= {"base", "formats", "q8x"}


@pytest.mark.parametrize("name", kernels.kernel_names())
def test_kernel_texts_reach_mlx_without_include_lines(name):
    kernel = kernels.source(name)
    assert "#include" not in kernel.header + kernel.body


def test_a_kernel_carries_only_the_helpers_it_uses():
    # MLX hashes the whole source at every launch: embedding decodes elements, nothing of the
    # products; qk_norm_rope needs one store.
    embedding = kernels.source("embedding").header
    assert "muser_value" in embedding and "muser_rows_dot" not in embedding and "muser_atomic_add" not in embedding
    assert kernels.source("qk_norm_rope").header.count("inline") == 2  # muser_store1, float and half
    assert kernels.source("argmax").header == ""
