"""GGUF file access: mmap once, validate everything, expose metadata and a tensor table.

Knows the file format only (no model knowledge). Parsing goes through the `gguf`
package's reader and constants; this module adds the bounds checks it lacks
(see `open_gguf`). Every problem is a `GGUFError` naming the file.

INTERFACE (implemented by the loader work; other modules rely on exactly this):

    gf = open_gguf(path, header_only=False)   # -> GGUFFile; raises GGUFError
    gf.path: str
    gf.version: int
    gf.alignment: int
    gf.data_offset: int                       # absolute offset of the tensor data section
    gf.metadata: dict[str, object]            # key -> str | int | float | bool | list (arrays as
                                              #   Python lists; token lists as list[str])
    gf.get(key, default=None)
    gf.tensors: dict[str, TensorInfo]         # in file order
    gf.raw(name) -> np.ndarray                # uint8 memmap view, shape (rows, row_bytes) for any
                                              #   type (row = last numpy dim = ggml ne[0]);
                                              #   header_only files raise GGUFError here
    gf.close()

    TensorInfo(name, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...] in numpy order
               (e.g. (n_out, n_in) for a linear weight; ggml's ne reversed),
               offset: int absolute file offset, nbytes: int, n_elements: int,
               row_bytes: int, n_rows: int)

`header_only=True` is for files that stop where tensor data starts (the 7B header
in models/): the tensor table is still validated (shapes, types, alignment,
overlap), but not against the end of the file.
"""
