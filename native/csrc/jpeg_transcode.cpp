// Lossless JPEG rewriting for pipeline-prepare (filled in by the prepare work).
#include <pybind11/pybind11.h>

#include "jpeg_strict.h"

namespace py = pybind11;

void register_transcode(py::module_& m) { (void)m; }
