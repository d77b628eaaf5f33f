// Fast index builders for the pretraining datasets (imported as megatron.data.helpers_cpp).
//
// build_sample_idx:       maps each GPT training sample (seq_length + 1 tokens, consecutive samples
//                         overlapping by one token) to (position in doc_idx, token offset) of its start.
// build_blending_indices: greedily assigns every sample of a blended dataset to the component dataset
//                         whose achieved share lags its weight the most.
// build_mapping:          BERT/T5 sentence-level samples mapping: rows (first sentence, last sentence exclusive,
//                         target length) over the documents, shuffled.
// All follow Megatron-LM's algorithms exactly so that index caches and sample order are interchangeable.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
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

// ---------------------------------------------------------------------------------------------------------------
// build_mapping (BERT / T5 samples mapping)

constexpr int32_t LONG_SENTENCE_LEN = 512;  // a document with 2+ sentences and one longer than this is skipped

// Target length of the next sample: max_length, or with probability ~1/short_seq_ratio a short one in
// [2, max_length]. Draws from the generator only when short samples are enabled (Megatron's rule).
inline int32_t target_sample_len(int32_t short_seq_ratio, int32_t max_length, std::mt19937& gen) {
  if (short_seq_ratio == 0) {
    return max_length;
  }
  const uint32_t r = static_cast<uint32_t>(gen());
  if (r % static_cast<uint32_t>(short_seq_ratio) == 0) {
    return 2 + static_cast<int32_t>(r % static_cast<uint32_t>(max_length - 1));
  }
  return max_length;
}

struct MappingStats {
  uint64_t empty_docs = 0;
  uint64_t one_sent_docs = 0;
  uint64_t long_sent_docs = 0;
  int32_t epochs_run = 0;
  bool reached_max = false;
};

// One pass over the epochs. With `out` null it only counts rows; otherwise it writes them. Both passes start from
// a fresh mt19937(seed), so they agree.
template <typename Out>
uint64_t mapping_pass(const int64_t* docs, int64_t num_doc_entries, const int32_t* sizes, int32_t num_epochs,
                      uint64_t max_num_samples, int32_t max_seq_length, int32_t short_seq_ratio, int32_t seed,
                      int32_t min_num_sent, Out* out, MappingStats* stats) {
  std::mt19937 gen(static_cast<uint32_t>(seed));
  uint64_t map_index = 0;
  for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
    // The stop is checked once per epoch, so the map can hold more than max_num_samples rows (as Megatron's).
    if (map_index >= max_num_samples) {
      stats->reached_max = true;
      break;
    }
    if (epoch == 1 && map_index == 0) {
      break;  // no document yields a sample; every further epoch would be empty too
    }
    stats->epochs_run = epoch + 1;
    for (int64_t doc = 0; doc + 1 < num_doc_entries; ++doc) {
      const int64_t first = docs[doc];
      const int64_t last = docs[doc + 1];
      int64_t remaining = last - first;
      if (epoch == 0 && out == nullptr) {
        if (remaining == 0) ++stats->empty_docs;
        if (remaining == 1) ++stats->one_sent_docs;
      }
      bool long_sentence = false;
      if (remaining > 1) {
        for (int64_t s = first; s < last; ++s) {
          if (sizes[s] > LONG_SENTENCE_LEN) {
            if (epoch == 0 && out == nullptr) ++stats->long_sent_docs;
            long_sentence = true;
            break;
          }
        }
      }
      if (remaining < min_num_sent || long_sentence) {
        continue;
      }
      int64_t start = first;
      int64_t seq_len = 0;
      int32_t num_sent = 0;
      int32_t target = target_sample_len(short_seq_ratio, max_seq_length, gen);
      for (int64_t s = first; s < last; ++s) {
        seq_len += sizes[s];
        ++num_sent;
        --remaining;
        // Emit when the target is reached (keeping at least two sentences for the rest of the document and
        // min_num_sent in this sample), or at the end of the document.
        if ((seq_len >= target && remaining > 1 && num_sent >= min_num_sent) || remaining == 0) {
          if (out != nullptr) {
            out[3 * map_index] = static_cast<Out>(start);
            out[3 * map_index + 1] = static_cast<Out>(s + 1);
            out[3 * map_index + 2] = static_cast<Out>(target);
          }
          ++map_index;
          start = s + 1;
          target = target_sample_len(short_seq_ratio, max_seq_length, gen);
          seq_len = 0;
          num_sent = 0;
        }
      }
    }
  }
  return map_index;
}

template <typename Out>
py::array build_mapping_impl(const py::array_t<int64_t>& docs_arr, const py::array_t<int32_t>& sizes_arr,
                             int32_t num_epochs, uint64_t max_num_samples, int32_t max_seq_length,
                             double short_seq_prob, int32_t seed, bool verbose, int32_t min_num_sent) {
  const int64_t* docs = docs_arr.data();
  const int32_t* sizes = sizes_arr.data();
  const int64_t num_doc_entries = docs_arr.shape(0);
  int32_t short_seq_ratio = 0;
  if (short_seq_prob > 0) {
    short_seq_ratio = static_cast<int32_t>(std::round(1.0 / short_seq_prob));
  }
  if (verbose) {
    const int64_t first = num_doc_entries > 0 ? docs[0] : 0;
    const int64_t last = num_doc_entries > 0 ? docs[num_doc_entries - 1] : 0;
    std::cout << "    using:" << std::endl
              << "     number of documents:            " << num_doc_entries - 1 << std::endl
              << "     sentences range:                [" << first << ", " << last << ")" << std::endl
              << "     total number of sentences:      " << last - first << std::endl
              << "     number of epochs:               " << num_epochs << std::endl
              << "     maximum number of samples:      " << max_num_samples << std::endl
              << "     maximum sequence length:        " << max_seq_length << std::endl
              << "     short sequence probability:     " << short_seq_prob << std::endl
              << "     short sequence ration (1/prob): " << short_seq_ratio << std::endl
              << "     seed:                           " << seed << std::endl
              << std::flush;
  }
  MappingStats stats;
  uint64_t num_samples = 0;
  Out* maps = nullptr;
  {
    py::gil_scoped_release release;
    num_samples = mapping_pass<Out>(docs, num_doc_entries, sizes, num_epochs, max_num_samples, max_seq_length,
                                    short_seq_ratio, seed, min_num_sent, nullptr, &stats);
  }
  if (verbose) {
    if (stats.reached_max) {
      std::cout << "    reached " << max_num_samples << " samples after " << stats.epochs_run << " epochs ..."
                << std::endl;
    }
    std::cout << "   number of empty documents: " << stats.empty_docs << std::endl
              << "   number of documents with one sentence: " << stats.one_sent_docs << std::endl
              << "   number of documents with long sentences: " << stats.long_sent_docs << std::endl
              << "   will create mapping for " << num_samples << " samples" << std::endl
              << std::flush;
  }
  if (num_samples > static_cast<uint64_t>(std::numeric_limits<int64_t>::max() / 3)) {
    throw std::overflow_error("build_mapping: number of samples exceeds what an int64 index can address");
  }
  py::array_t<Out> result({static_cast<py::ssize_t>(num_samples), static_cast<py::ssize_t>(3)});
  maps = result.mutable_data();
  {
    py::gil_scoped_release release;
    MappingStats unused;
    mapping_pass<Out>(docs, num_doc_entries, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_ratio,
                      seed, min_num_sent, maps, &unused);
    // Fisher-Yates over the rows with a 64-bit generator (there may be more than 2^32 rows).
    std::mt19937_64 gen64(static_cast<uint64_t>(seed + 1));
    for (int64_t i = static_cast<int64_t>(num_samples) - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(gen64() % static_cast<uint64_t>(i + 1));
      std::swap(maps[3 * i], maps[3 * j]);
      std::swap(maps[3 * i + 1], maps[3 * j + 1]);
      std::swap(maps[3 * i + 2], maps[3 * j + 2]);
    }
  }
  return std::move(result);
}

py::array build_mapping(const py::array& docs_obj, const py::array& sizes_obj, int32_t num_epochs,
                        uint64_t max_num_samples, int32_t max_seq_length, double short_seq_prob, int32_t seed,
                        bool verbose, int32_t min_num_sent) {
  if (num_epochs <= 0) {
    throw py::value_error("build_mapping: num_epochs must be positive, got " + std::to_string(num_epochs));
  }
  if (max_seq_length <= 1) {
    throw py::value_error("build_mapping: max_seq_length must be at least 2, got " + std::to_string(max_seq_length));
  }
  if (!(short_seq_prob >= 0.0 && short_seq_prob <= 1.0)) {
    throw py::value_error("build_mapping: short_seq_prob must be in [0, 1], got " + std::to_string(short_seq_prob));
  }
  if (seed < 0) {
    throw py::value_error("build_mapping: seed must be non-negative, got " + std::to_string(seed));
  }
  if (min_num_sent < 1) {
    throw py::value_error("build_mapping: min_num_sent must be at least 1, got " + std::to_string(min_num_sent));
  }
  auto docs = typed_input<int64_t>(docs_obj, "docs", "int64");
  auto sizes = typed_input<int32_t>(sizes_obj, "sizes", "int32");
  const int64_t n_docs = docs.shape(0);
  const int64_t* d = docs.data();
  for (int64_t i = 0; i < n_docs; ++i) {
    if (d[i] < 0 || d[i] > sizes.shape(0) || (i > 0 && d[i] < d[i - 1])) {
      throw py::value_error("build_mapping: docs must be non-decreasing sentence indices within [0, " +
                            std::to_string(sizes.shape(0)) + "]; entry " + std::to_string(i) + " is " +
                            std::to_string(d[i]));
    }
  }
  if (static_cast<uint64_t>(sizes.shape(0)) > std::numeric_limits<uint32_t>::max()) {
    if (verbose) std::cout << "    using uint64 for data mapping..." << std::endl;
    return build_mapping_impl<uint64_t>(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                                        seed, verbose, min_num_sent);
  }
  if (verbose) std::cout << "    using uint32 for data mapping..." << std::endl;
  return build_mapping_impl<uint32_t>(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed,
                                      verbose, min_num_sent);
}

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "Dataset index builders for megatron-lite (GPT sample index, dataset blending, BERT/T5 mapping).";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"), py::arg("seq_length"),
        py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        "Start (doc_idx position, offset) of every seq_length+1 token sample; shape [num_samples + 1, 2].");
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index"), py::arg("dataset_sample_index"),
        py::arg("weights"), py::arg("num_datasets"), py::arg("size"), py::arg("verbose"),
        "Fill dataset_index (uint8) and dataset_sample_index (int64) in place for a weighted blend.");
  m.def("build_mapping", &build_mapping, py::arg("docs"), py::arg("sizes"), py::arg("num_epochs"),
        py::arg("max_num_samples"), py::arg("max_seq_length"), py::arg("short_seq_prob"), py::arg("seed"),
        py::arg("verbose"), py::arg("min_num_sent"),
        "BERT/T5 samples mapping: shuffled rows (first sentence, last sentence exclusive, target length).");
}
