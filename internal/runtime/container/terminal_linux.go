package container

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// Terminal allocates a terminal from the sandbox's own devpts
// (backend.Terminaler).
func (s *Conn) Terminal() (master, tty *os.File, err error) { return TerminalOf(s.Pid()) }

// TerminalOf allocates a terminal from the sandbox's own devpts (its
// /dev/pts/ptmx, reached through its init's root), so that the command
// finds its terminal under /dev/pts: ttyname() and tty(1) name it, as
// they could not name one of the host's instance. The path is resolved
// inside the sandbox's root without following any link, and what it
// opens must be a devpts ptmx, whatever the agent mounted there; the
// terminal's other end comes from the master (TIOCGPTPEER), by no path.
func TerminalOf(pid int) (master, tty *os.File, err error) {
	if pid <= 0 {
		return nil, nil, errors.New("the sandbox has no init to give a terminal")
	}
	root, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("the sandbox's root: %w", err)
	}
	defer unix.Close(root)
	fd, err := unix.Openat2(root, "dev/pts/ptmx", &unix.OpenHow{Flags: unix.O_RDWR | unix.O_NOCTTY | unix.O_NONBLOCK | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
	if err != nil {
		return nil, nil, fmt.Errorf("the sandbox's /dev/pts/ptmx: %w", err)
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	var st unix.Stat_t
	var sfs unix.Statfs_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, nil, err
	}
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return nil, nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != 5 || unix.Minor(st.Rdev) != 2 || sfs.Type != unix.DEVPTS_SUPER_MAGIC {
		return nil, nil, errors.New("the sandbox's /dev/pts/ptmx is not a devpts terminal multiplexer")
	}
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		return nil, nil, fmt.Errorf("unlock the terminal: %w", err)
	}
	peer, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TIOCGPTPEER, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC)
	if errno != 0 {
		return nil, nil, fmt.Errorf("open the terminal: %w", errno)
	}
	// The master stays non-blocking, for the runtime's poller.
	return os.NewFile(uintptr(fd), "ptmx"), os.NewFile(peer, "tty"), nil
}
