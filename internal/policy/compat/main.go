//go:build linux

// Command compat is the policy test suite's ordinary program: run inside
// a sandbox under the default policy, it does what agents' tools do
// every day and prints one line per check, its name and what it saw (or
// "error: ..."). It is built by the tests, statically, and never
// shipped.
package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	dir := os.TempDir()
	checks := []struct {
		name string
		run  func() (string, error)
	}{
		{"interfaces", interfaces},
		{"inotify", func() (string, error) { return inotify(dir) }},
		{"eventfd", eventfd},
		{"timerfd", timerfd},
		{"epoll", epoll},
		{"shm", shm},
		{"tcp loopback", tcpLoopback},
	}
	for _, c := range checks {
		out, err := c.run()
		if err != nil {
			out = "error: " + err.Error()
		}
		fmt.Printf("%s\t%s\n", c.name, out)
	}
}

// interfaces lists the interfaces and their addresses (NETLINK_ROUTE).
func interfaces() (string, error) {
	ifs, err := net.Interfaces() // RTM_GETLINK over NETLINK_ROUTE
	if err != nil {
		return "", err
	}
	var out []string
	for _, i := range ifs {
		addrs, err := i.Addrs() // RTM_GETADDR
		if err != nil {
			return "", err
		}
		for _, a := range addrs {
			out = append(out, i.Name+"="+a.String())
		}
	}
	return strings.Join(out, " "), nil
}

// inotify watches dir and sees a file made in it.
func inotify(dir string) (string, error) {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_CREATE); err != nil {
		return "", err
	}
	p := filepath.Join(dir, "compat-inotify")
	os.Remove(p)
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		return "", err
	}
	defer os.Remove(p)
	buf := make([]byte, 4096)
	n, err := unix.Read(fd, buf)
	if err != nil {
		return "", err
	}
	ev := buf[unix.SizeofInotifyEvent:n]
	return "created " + strings.TrimRight(string(ev), "\x00"), nil
}

// eventfd adds to an eventfd's counter and reads it.
func eventfd() (string, error) {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	b := make([]byte, 8)
	b[0] = 3
	if _, err := unix.Write(fd, b); err != nil {
		return "", err
	}
	if _, err := unix.Read(fd, b); err != nil {
		return "", err
	}
	return fmt.Sprint("counter ", b[0]), nil
}

// timerfd waits for a timerfd to expire.
func timerfd() (string, error) {
	fd, err := unix.TimerfdCreate(unix.CLOCK_MONOTONIC, unix.TFD_CLOEXEC)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	spec := unix.ItimerSpec{Value: unix.NsecToTimespec(int64(time.Millisecond))}
	if err := unix.TimerfdSettime(fd, 0, &spec, nil); err != nil {
		return "", err
	}
	b := make([]byte, 8)
	if _, err := unix.Read(fd, b); err != nil {
		return "", err
	}
	return fmt.Sprint("expired ", b[0]), nil
}

// epoll waits with epoll for a pipe to be readable.
func epoll() (string, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return "", err
	}
	defer unix.Close(ep)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return "", err
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, p[0], &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(p[0])}); err != nil {
		return "", err
	}
	unix.Write(p[1], []byte("x"))
	evs := make([]unix.EpollEvent, 4)
	n, err := unix.EpollWait(ep, evs, 1000)
	if err != nil {
		return "", err
	}
	return fmt.Sprint(n, " ready"), nil
}

// shm shares memory through a file of /dev/shm.
func shm() (string, error) {
	// shm_open is an open of /dev/shm/NAME.
	p := "/dev/shm/dsec-compat"
	fd, err := unix.Open(p, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return "", err
	}
	defer unix.Unlink(p)
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 4096); err != nil {
		return "", err
	}
	m, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return "", err
	}
	copy(m, "shared memory")
	unix.Munmap(m)
	b := make([]byte, 13)
	if _, err := unix.Pread(fd, b, 0); err != nil {
		return "", err
	}
	return string(b), nil
}

// tcpLoopback echoes over a TCP connection on the loopback.
func tcpLoopback() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Write([]byte("echo"))
			c.Close()
		}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		return "", err
	}
	defer c.Close()
	b := make([]byte, 4)
	_, err = c.Read(b)
	return string(b), err
}
