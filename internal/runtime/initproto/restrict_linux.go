package initproto

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ApplyRestrictions loads r on the calling thread; no_new_privs is set
// already.
func ApplyRestrictions(r *Restrictions) error {
	if r == nil {
		return nil
	}
	if r.Writable != nil {
		if err := confineWrites(r.Writable); err != nil {
			return err
		}
	}
	if len(r.Seccomp) == 0 {
		return nil
	}
	if len(r.Seccomp)%8 != 0 || len(r.Seccomp)/8 > unix.BPF_MAXINSNS {
		return fmt.Errorf("seccomp program of %d bytes: not a filter", len(r.Seccomp))
	}
	filter := make([]unix.SockFilter, len(r.Seccomp)/8)
	for i := range filter {
		b := r.Seccomp[8*i:]
		filter[i] = unix.SockFilter{Code: binary.NativeEndian.Uint16(b), Jt: b[2], Jf: b[3], K: binary.NativeEndian.Uint32(b[4:])}
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if _, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&prog))); errno != 0 {
		return fmt.Errorf("load the seccomp filter: %w", errno)
	}
	return nil
}

// writeRights are the Landlock rights that change a file tree.
const writeRights = unix.LANDLOCK_ACCESS_FS_WRITE_FILE | unix.LANDLOCK_ACCESS_FS_REMOVE_DIR | unix.LANDLOCK_ACCESS_FS_REMOVE_FILE |
	unix.LANDLOCK_ACCESS_FS_MAKE_CHAR | unix.LANDLOCK_ACCESS_FS_MAKE_DIR | unix.LANDLOCK_ACCESS_FS_MAKE_REG |
	unix.LANDLOCK_ACCESS_FS_MAKE_SOCK | unix.LANDLOCK_ACCESS_FS_MAKE_FIFO | unix.LANDLOCK_ACCESS_FS_MAKE_BLOCK |
	unix.LANDLOCK_ACCESS_FS_MAKE_SYM | unix.LANDLOCK_ACCESS_FS_REFER | unix.LANDLOCK_ACCESS_FS_TRUNCATE

// confineWrites restricts the calling thread (and what it starts) to
// changing only the trees under writable, /dev and /proc, with a
// Landlock domain; paths missing in the root are skipped.
func confineWrites(writable []string) error {
	abi, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION)
	if errno != 0 {
		return fmt.Errorf("files.readWrite needs Landlock, which this kernel does not offer (%v): leave readWrite out or run a kernel with Landlock", errno)
	}
	handled := uint64(writeRights)
	if abi < 2 {
		handled &^= unix.LANDLOCK_ACCESS_FS_REFER
	}
	if abi < 3 {
		handled &^= unix.LANDLOCK_ACCESS_FS_TRUNCATE
	}
	attr := unix.LandlockRulesetAttr{Handled_access_fs: handled}
	// Only the first field: every Landlock ABI reads a ruleset that short.
	r, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, uintptr(unsafe.Pointer(&attr)), 8, 0)
	if errno != 0 {
		return fmt.Errorf("landlock ruleset: %w", errno)
	}
	rs := int(r)
	defer unix.Close(rs)
	for _, p := range append([]string{"/dev", "/proc"}, writable...) {
		fd, err := unix.Openat2(unix.AT_FDCWD, p, &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return fmt.Errorf("files.readWrite %s: %w", p, err)
		}
		rule := unix.LandlockPathBeneathAttr{Allowed_access: handled, Parent_fd: int32(fd)}
		var st unix.Stat_t
		if unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT != unix.S_IFDIR {
			rule.Allowed_access &= unix.LANDLOCK_ACCESS_FS_WRITE_FILE | unix.LANDLOCK_ACCESS_FS_TRUNCATE // all a file can take
		}
		_, _, errno := unix.Syscall6(unix.SYS_LANDLOCK_ADD_RULE, uintptr(rs), unix.LANDLOCK_RULE_PATH_BENEATH, uintptr(unsafe.Pointer(&rule)), 0, 0, 0)
		unix.Close(fd)
		if errno != 0 {
			return fmt.Errorf("files.readWrite %s: landlock rule: %w", p, errno)
		}
	}
	if _, _, errno := unix.Syscall(unix.SYS_LANDLOCK_RESTRICT_SELF, uintptr(rs), 0, 0); errno != 0 {
		return fmt.Errorf("landlock: %w", errno)
	}
	return nil
}
