/* Holds one KVM VM open for the life of the harness's outer guest.
 *
 * Linux patches __schedule's code (the preempt_notifier_key static key,
 * text_poke_bp: int3 and cross-CPU syncs) whenever the number of KVM VMs
 * goes between 0 and 1. Under QEMU 7.2's multi-threaded TCG that patching
 * can leave both vCPUs looping in exc_int3 at __schedule for good (seen as
 * a hung outer guest, RFL without IF, RIP in asm_exc_int3). outer-init runs
 * this once at boot, before any test creates a VM, so the key is patched
 * once, while the guest is idle, and never again (it pins the cgroup keys
 * the same way: docs/kvm-harness.md).
 * Prints "ready" when the VM exists, then sleeps until killed. */
#include <fcntl.h>
#include <linux/kvm.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <unistd.h>

int main(void) {
  int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (kvm < 0) {
    perror("kvm-pin: /dev/kvm");
    return 1;
  }
  int vm = ioctl(kvm, KVM_CREATE_VM, 0);
  if (vm < 0) {
    perror("kvm-pin: KVM_CREATE_VM");
    return 1;
  }
  printf("ready\n");
  fflush(stdout);
  for (;;) pause();
}
