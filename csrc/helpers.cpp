// Fast index builders for the pretraining datasets (imported as megatron.data.helpers_cpp).
//
// build_sample_idx:       maps each GPT training sample (seq_length + 1 tokens, consecutive samples
//                         overlapping by one token) to (position in doc_idx, token offset) of its start.
// build_blending_indices: greedily assigns every sample of a blended dataset to the component dataset
//                         whose achieved share lags its weight the most.
// Both follow Megatron-LM's algorithms exactly so that index caches and sample order are interchangeable.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

std::string dtype_name(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

void require_1d(const py::array& a, const char* name) {
  if (a.ndim() != 1) {
    throw py::value_error(std::string(name) + " must be a 1-D array, got " + std::to_string(a.ndim()) +
                          " dimensions");
  }
}

// Returns a contiguous typed view of `obj`, or raises a clear error naming the argument and expected dtype.
template <typename T>
py::array_t<T> typed_input(const py::array& obj, const char* name, const char* expected) {
  if (!py::isinstance<py::array_t<T>>(obj)) {
    throw py::type_error(std::string(name) + " must be a numpy array of dtype " + expected + ", got " +
                         dtype_name(obj) + " (convert it with .astype(np." + expected + "))");
  }
  require_1d(obj, name);
  // Non-contiguous inputs (e.g. strided views) are copied once; the result is still correct.
  return py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(obj);
}

template <typename DocIdx, typename Out>
py::array build_sample_idx_impl(const py::array_t<int32_t>& sizes_arr, const py::array_t<DocIdx>& doc_idx_arr,
                                int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  const int32_t* sizes = sizes_arr.data();
  const DocIdx* doc_idx = doc_idx_arr.data();
  const int64_t num_docs = sizes_arr.shape(0);
  const int64_t doc_idx_len = doc_idx_arr.shape(0);

  // Each sample needs seq_length + 1 tokens, but the last token of one sample is the first of the next.
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  if (doc_idx_len >= static_cast<int64_t>(std::numeric_limits<Out>::max()) ||
      num_samples >= static_cast<int64_t>(std::numeric_limits<Out>::max())) {
    throw py::value_error("build_sample_idx: too many documents/samples for an int32 index; pass doc_idx as int64");
  }

  py::array_t<Out> result({static_cast<py::ssize_t>(num_samples + 1), static_cast<py::ssize_t>(2)});
  Out* out = result.mutable_data();
  bool overrun = false;
  bool bad_doc = false;
  int64_t bad_doc_id = 0;
  {
    py::gil_scoped_release release;
    int64_t sample_index = 0;
    int64_t doc_idx_index = 0;
    int64_t doc_offset = 0;
    out[0] = 0;
    out[1] = 0;
    ++sample_index;
    while (sample_index <= num_samples && !overrun && !bad_doc) {
      int64_t remaining = seq_length + 1;
      while (remaining != 0) {
        if (doc_idx_index >= doc_idx_len) {
          overrun = true;
          break;
        }
        const int64_t doc_id = static_cast<int64_t>(doc_idx[doc_idx_index]);
        if (doc_id < 0 || doc_id >= num_docs) {
          bad_doc = true;
          bad_doc_id = doc_id;
          break;
        }
        const int64_t doc_length = static_cast<int64_t>(sizes[doc_id]) - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample ends inside this document; -1 because its last token is shared with the next sample.
          doc_offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++doc_idx_index;
          doc_offset = 0;
        }
      }
      out[2 * sample_index] = static_cast<Out>(doc_idx_index);
      out[2 * sample_index + 1] = static_cast<Out>(doc_offset);
      ++sample_index;
    }
  }
  if (bad_doc) {
    throw py::value_error("build_sample_idx: doc_idx contains document " + std::to_string(bad_doc_id) +
                          " but sizes has only " + std::to_string(num_docs) + " entries");
  }
  if (overrun) {
    throw py::value_error(
        "build_sample_idx: ran past the end of doc_idx; num_epochs * tokens_per_epoch is larger than the "
        "number of tokens in the documents listed by doc_idx");
  }
  return std::move(result);
}

py::array build_sample_idx(const py::array& sizes_obj, const py::array& doc_idx_obj, int64_t seq_length,
                           int64_t num_epochs, int64_t tokens_per_epoch) {
  if (seq_length <= 0) {
    throw py::value_error("build_sample_idx: seq_length must be positive, got " + std::to_string(seq_length));
  }
  if (num_epochs <= 0) {
    throw py::value_error("build_sample_idx: num_epochs must be positive, got " + std::to_string(num_epochs));
  }
  if (tokens_per_epoch <= 0) {
    throw py::value_error("build_sample_idx: tokens_per_epoch must be positive, got " +
                          std::to_string(tokens_per_epoch) + " (are all documents empty?)");
  }
  auto sizes = typed_input<int32_t>(sizes_obj, "sizes", "int32");
  // Like Megatron: int32 doc_idx gives an int32 sample index, int64 doc_idx an int64 one.
  if (py::isinstance<py::array_t<int32_t>>(doc_idx_obj)) {
    auto doc_idx = typed_input<int32_t>(doc_idx_obj, "doc_idx", "int32");
    return build_sample_idx_impl<int32_t, int32_t>(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch);
  }
  auto doc_idx = typed_input<int64_t>(doc_idx_obj, "doc_idx", "int64");
  return build_sample_idx_impl<int64_t, int64_t>(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch);
}

void build_blending_indices(py::array& dataset_index_obj, py::array& dataset_sample_index_obj,
                            const py::array& weights_obj, int32_t num_datasets, int64_t size, bool verbose) {
  if (!py::isinstance<py::array_t<uint8_t>>(dataset_index_obj)) {
    throw py::type_error("dataset_index must be a numpy array of dtype uint8, got " + dtype_name(dataset_index_obj));
  }
  if (!py::isinstance<py::array_t<int64_t>>(dataset_sample_index_obj)) {
    throw py::type_error("dataset_sample_index must be a numpy array of dtype int64, got " +
                         dtype_name(dataset_sample_index_obj));
  }
  require_1d(dataset_index_obj, "dataset_index");
  require_1d(dataset_sample_index_obj, "dataset_sample_index");
  const int flags = py::array::c_style;
  if (!(dataset_index_obj.flags() & flags) || !(dataset_sample_index_obj.flags() & flags) ||
      !dataset_index_obj.writeable() || !dataset_sample_index_obj.writeable()) {
    throw py::value_error("dataset_index and dataset_sample_index must be writable C-contiguous arrays (filled in place)");
  }
  if (num_datasets <= 0 || num_datasets > 255) {
    throw py::value_error("build_blending_indices: num_datasets must be in [1, 255], got " +
                          std::to_string(num_datasets));
  }
  if (size < 0 || dataset_index_obj.shape(0) < size || dataset_sample_index_obj.shape(0) < size) {
    throw py::value_error("build_blending_indices: output arrays are shorter than size=" + std::to_string(size));
  }
  auto weights_arr = typed_input<double>(weights_obj, "weights", "float64");
  if (weights_arr.shape(0) != num_datasets) {
    throw py::value_error("build_blending_indices: weights has " + std::to_string(weights_arr.shape(0)) +
                          " entries but num_datasets is " + std::to_string(num_datasets));
  }
  if (verbose) {
    std::cout << "> building indices for blendable datasets ..." << std::endl;
  }
  auto* dataset_index = static_cast<uint8_t*>(dataset_index_obj.mutable_data());
  auto* dataset_sample_index = static_cast<int64_t*>(dataset_sample_index_obj.mutable_data());
  const double* weights = weights_arr.data();
  std::vector<int64_t> current(num_datasets, 0);
  {
    py::gil_scoped_release release;
    for (int64_t sample_idx = 0; sample_idx < size; ++sample_idx) {
      // Pick the dataset whose achieved count lags its target (weight * samples so far) the most.
      const double progress = std::max(static_cast<double>(sample_idx), 1.0);
      int64_t best = 0;
      double best_error = weights[0] * progress - static_cast<double>(current[0]);
      for (int64_t d = 1; d < num_datasets; ++d) {
        const double error = weights[d] * progress - static_cast<double>(current[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      dataset_index[sample_idx] = static_cast<uint8_t>(best);
      dataset_sample_index[sample_idx] = current[best];
      current[best] += 1;
    }
  }
  if (verbose) {
    std::cout << " > sample ratios:" << std::endl;
    for (int64_t d = 0; d < num_datasets; ++d) {
      const double ratio = size > 0 ? static_cast<double>(current[d]) / static_cast<double>(size) : 0.0;
      std::cout << "   dataset " << d << ", input: " << weights[d] << ", achieved: " << ratio << std::endl;
    }
  }
}

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "Dataset index builders for megatron-lite (GPT sample index, dataset blending).";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"), py::arg("seq_length"),
        py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        "Start (doc_idx position, offset) of every seq_length+1 token sample; shape [num_samples + 1, 2].");
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index"), py::arg("dataset_sample_index"),
        py::arg("weights"), py::arg("num_datasets"), py::arg("size"), py::arg("verbose"),
        "Fill dataset_index (uint8) and dataset_sample_index (int64) in place for a weighted blend.");
}
