#include "ngram.h"

#include <algorithm>

namespace specengine {

std::vector<int64_t> ngram_propose(const int64_t* tokens, int64_t length, int64_t min_n,
                                   int64_t max_n, int64_t max_drafts) {
  for (int64_t n = std::min(max_n, length - 1); n >= min_n; --n) {
    const int64_t* suffix = tokens + length - n;
    // A match must end before the suffix starts, so at least one token follows it.
    for (int64_t start = length - n - 1; start >= 0; --start) {
      if (std::equal(suffix, suffix + n, tokens + start)) {
        const int64_t first = start + n;
        const int64_t last = std::min(first + max_drafts, length);
        return std::vector<int64_t>(tokens + first, tokens + last);
      }
    }
  }
  return {};
}

}  // namespace specengine
