#pragma once
#include <cstdint>
#include <vector>

namespace specengine {

// Prompt-lookup drafting (Leviathan et al. Section 3.6; Saxena's prompt lookup):
// find the most recent earlier occurrence of the sequence's last n tokens, trying
// n = max_n down to min_n, and return up to max_drafts tokens that followed it.
// Returns an empty vector when no suffix of length >= min_n re-occurs.
std::vector<int64_t> ngram_propose(const int64_t* tokens, int64_t length, int64_t min_n,
                                   int64_t max_n, int64_t max_drafts);

}  // namespace specengine
