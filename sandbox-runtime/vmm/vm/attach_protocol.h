// The attach protocol's constants (attach.h), shared by sandgate-vmm and
// the kvm runtime that attaches to it.
#pragma once

namespace sg::vmm {

inline constexpr int kAttachFd = 9;  // the same number as the agent's re-attach descriptor
inline constexpr char kAttachHello[8] = {'S', 'G', 'A', 'T', 'T', 'A', 'C', 'H'};

}  // namespace sg::vmm
