// A libtorch program hands a tensor to a Python PyTorch process by name,
// through the shared-memory manager, and sees what Python wrote into it.
//   share_tensor PYTHON      (a python with torch installed)
#include <ATen/ATen.h>
#include <storage_sharing/torch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace sst = storage_sharing::libtorch;

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s PYTHON\n", argv[0]);
        return 2;
    }
    try {
        // Born in shared memory: sharing it later copies nothing.
        at::Tensor t = sst::empty_shared({2, 3}, at::kFloat);
        t.copy_(at::arange(6, at::kFloat).reshape({2, 3}));

        // What storage._share_filename_cpu_() returns in Python.
        storage_sharing::SharedFilename s = sst::share_filename(t.storage());
        sst::shared_incref(t.storage());  // the reference in flight
        std::printf("shared %s (%zu bytes) through %s\n", s.name.c_str(), s.nbytes, s.manager.c_str());
        std::fflush(stdout);

        // The Python side: open it, drop the in-flight reference, rebuild
        // the tensor, double it in place.
        std::string code =
            "import sys, torch\n"
            "s = torch.UntypedStorage._new_shared_filename_cpu(sys.argv[1].encode(), sys.argv[2].encode(), int(sys.argv[3]))\n"
            "s._shared_decref()\n"
            "t = torch.empty(0).set_(s, 0, (2, 3), (3, 1))\n"
            "t.mul_(2)\n"
            "print('python saw', t.sum().item())\n";
        std::string cmd = std::string(argv[1]) + " -c \"" + code + "\" " + s.manager + " " + s.name + " " +
                          std::to_string(s.nbytes);
        if (std::system(cmd.c_str()) != 0) return 1;

        std::printf("C++ sees");
        for (int i = 0; i < 6; i++) {
            float v = t.flatten()[i].item<float>();
            std::printf(" %g", v);
            if (v != 2.0f * i) return 1;
        }
        std::printf("\nok\n");
    } catch (const storage_sharing::Error &e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
    // The last reference goes with `t`: the segment's name is removed.
    return 0;
}
