// The C++ layer of the content store: RAII handles, exceptions with the
// status, the same store read back.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "storage_sharing.hpp"

namespace ss = storage_sharing;

int main() {
    char dir[] = "/tmp/ss-content-cpp-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    std::vector<double> values(24);
    for (std::size_t i = 0; i < values.size(); i++) values[i] = static_cast<double>(i) / 3.0;
    const std::size_t nbytes = values.size() * sizeof(double);
    std::string hash;
    {
        ss::ContentWriter w(dir);
        w.set_durable(false);
        w.write_tensor("a/full", values.data(), nbytes, SS_DTYPE_FLOAT64, 0, {2, 3, 4}, {12, 4, 1});
        w.write_tensor("a/slice", values.data(), nbytes, SS_DTYPE_FLOAT64, 4, {2, 4}, {12, 1});
        hash = w.write_storage(values.data(), nbytes);
        ss::ContentCounts c = w.counts();
        CHECK(c.storages_written == 1 && c.storages_deduplicated == 2 && c.tensors_written == 2);
        expect_error([&] { w.write_tensor("../x", values.data(), nbytes, SS_DTYPE_FLOAT64, 0, {1}, {1}); }, SS_ERR_INVALID_ARGUMENT);
        expect_error([&] { w.write_tensor("x", values.data(), nbytes, SS_DTYPE_FLOAT64, 0, {25}, {1}); }, SS_ERR_INVALID_ARGUMENT);
    }
    ss::ContentReader r(dir);
    CHECK(r.format() == SS_CONTENT_FORMAT_NATIVE);
    r.set_verify(true);
    ss::ContentTensor t = r.read_tensor("a/slice");
    CHECK(t.dtype() == SS_DTYPE_FLOAT64 && t.offset() == 4 && t.storage_hash() == hash);
    CHECK((t.shape() == std::vector<std::int64_t>{2, 4}) && (t.stride() == std::vector<std::int64_t>{12, 1}));
    const double *d = static_cast<const double *>(t.data());
    CHECK(d[4 + 12 + 3] == values[19]);
    ss::ContentStorage s = r.read_storage(hash);
    CHECK(s.data() == t.data() && s.nbytes() == nbytes);
    CHECK((r.list_tensors() == std::vector<std::string>{"a/full", "a/slice"}));
    CHECK(r.list_storages().size() == 1);
    std::uint64_t checked = 0;
    CHECK(r.verify(&checked).empty() && checked == 3);
    expect_error([&] { r.read_tensor("nope"); }, SS_ERR_NOT_FOUND);
    CHECK(ss::hash_bytes("abc", 3, SS_HASH_STABLE) == "a9993e364706816aba3e25717850c26c9cd0d89d");
    std::string cmd = std::string("rm -rf '") + dir + "'";
    CHECK(std::system(cmd.c_str()) == 0);
    return 0;
}
