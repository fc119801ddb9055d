package image_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// BenchmarkImport pulls one multi-layer image (a Debian root, a
// toolchain layer over it that deletes a file, a repository layer) from
// a registry on 127.0.0.1 into a fresh store with dsec, and with
// containerd's ctr (Debian's, overlayfs snapshotter, unpacked) into a
// fresh containerd root, alternating, and with dsec again, the layers'
// files compressed (image.Options.Compress). It reports the wall time
// of each and the bytes each wrote (write_bytes of /proc/PID/io: dsec's
// own process, containerd's daemon), and what each keeps on disk.
func BenchmarkImport(b *testing.B) {
	layertest.RequireRoot(b)
	if _, err := exec.LookPath("ctr"); err != nil {
		b.Skip("SKIPPED: containerd's ctr is missing (make bench installs Debian's containerd)")
	}
	debian, addr, _, l := benchImages(b)
	must := func(err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	must(l.Layer("", "v1", func(root string) error {
		return exec.Command("cp", "-a", debian+"/.", root).Run()
	}))
	must(l.Layer("v1", "v1", func(root string) error {
		os.Remove(filepath.Join(root, "etc/motd"))
		return exec.Command("cp", "-a", filepath.Join(root, "usr/lib/x86_64-linux-gnu"), filepath.Join(root, "opt/toolchain")).Run()
	}))
	must(l.Layer("v1", "v1", func(root string) error {
		for i := range 200 {
			buf := make([]byte, 100<<10)
			for j := range buf {
				buf[j] = byte(i * j)
			}
			if err := os.MkdirAll(filepath.Join(root, "repo", strconv.Itoa(i%10)), 0o755); err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(root, "repo", strconv.Itoa(i%10), fmt.Sprintf("f%d", i)), buf, 0o644); err != nil {
				return err
			}
		}
		return nil
	}))
	must(l.Push(addr, "bench", "v1"))
	ref := mustParse(b, addr+"/bench:v1")

	var dsecS, ctrS, dsecW, ctrW, dsecDisk, ctrDisk float64
	var zS, zW, zDisk float64 // dsec, the layers' files compressed
	dsecPull := func(o image.Options, secs, written, disk *float64) {
		dir := b.TempDir() // a fresh store
		s, err := store.Open(filepath.Join(dir, "store"))
		must(err)
		w0 := writeBytes(b, os.Getpid())
		t0 := time.Now()
		if _, err := image.Import(context.Background(), s, ref, o); err != nil {
			b.Fatal(err)
		}
		syscall.Sync()
		*secs += time.Since(t0).Seconds()
		*written += float64(writeBytes(b, os.Getpid()) - w0)
		*disk += float64(du(b, dir))
		os.RemoveAll(dir)
	}
	for range b.N {
		dsecPull(image.Options{}, &dsecS, &dsecW, &dsecDisk)
		dsecPull(image.Options{Compress: true}, &zS, &zW, &zDisk)

		// containerd: a fresh root, its daemon started before the clock.
		root := b.TempDir()
		pid, sock, stopd := containerd(b, root)
		w0 := writeBytes(b, pid)
		t0 := time.Now()
		out, err := exec.Command("ctr", "-a", sock, "-n", "bench", "images", "pull", "--plain-http", addr+"/bench:v1").CombinedOutput()
		if err != nil {
			stopd()
			b.Fatalf("ctr pull: %v\n%s", err, out)
		}
		syscall.Sync()
		ctrS += time.Since(t0).Seconds()
		ctrW += float64(writeBytes(b, pid) - w0)
		ctrDisk += float64(du(b, root))
		stopd()
	}
	n := float64(b.N)
	b.ReportMetric(dsecS/n, "dsec-s")
	b.ReportMetric(ctrS/n, "ctr-s")
	b.ReportMetric(dsecW/n/1e6, "dsec-written-MB")
	b.ReportMetric(ctrW/n/1e6, "ctr-written-MB")
	b.ReportMetric(dsecDisk/n/1e6, "dsec-disk-MB")
	b.ReportMetric(ctrDisk/n/1e6, "ctr-disk-MB")
	b.ReportMetric(zS/n, "dsec-z-s")
	b.ReportMetric(zW/n/1e6, "dsec-z-written-MB")
	b.ReportMetric(zDisk/n/1e6, "dsec-z-disk-MB")
}

// benchImages is what an import benchmark builds its images from: the
// Debian root, a registry on 127.0.0.1 (its address and directory; it
// stops with b) and an OCI layout.
func benchImages(b *testing.B) (debian, addr, regDir string, l *layertest.Layout) {
	debian, err := layertest.DebianRoot()
	if err != nil {
		b.Fatal(err)
	}
	exe, err := layertest.Registry()
	if err != nil {
		b.Fatal(err)
	}
	regDir = b.TempDir()
	addr, stop, err := layertest.RunRegistry(exe, regDir, "")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(stop)
	if l, err = layertest.NewLayout(filepath.Join(b.TempDir(), "layout")); err != nil {
		b.Fatal(err)
	}
	return debian, addr, regDir, l
}

func mustParse(b *testing.B, s string) image.Reference {
	r, err := image.ParseReference(s)
	if err != nil {
		b.Fatal(err)
	}
	return r
}

// containerd starts a containerd of its own on root, and returns its pid,
// socket and what stops it (and unmounts what it left).
func containerd(b *testing.B, root string) (int, string, func()) {
	sock := filepath.Join(root, "c.sock")
	cfg := filepath.Join(root, "config.toml")
	os.WriteFile(cfg, []byte("version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n"), 0o644)
	cmd := exec.Command("containerd", "--config", cfg, "--root", filepath.Join(root, "root"), "--state", filepath.Join(root, "state"), "--address", sock)
	logf, _ := os.Create(filepath.Join(root, "containerd.log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	stop := func() {
		cmd.Process.Kill()
		cmd.Wait()
		logf.Close()
		exec.Command("sh", "-c", "grep -o ' "+root+"[^ ]*' /proc/self/mounts | xargs -r -n1 umount -l").Run()
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if exec.Command("ctr", "-a", sock, "version").Run() == nil {
			return cmd.Process.Pid, sock, stop
		}
		if time.Now().After(deadline) {
			stop()
			log, _ := os.ReadFile(filepath.Join(root, "containerd.log"))
			b.Fatalf("containerd did not start:\n%s", log)
		}
	}
}

// writeBytes is what pid has caused to be written to storage: the page
// cache it dirtied (write_bytes) less what it truncated before any of it
// was written (cancelled_write_bytes), as proc(5) says to count them (a
// file written and removed at once, such as an import's spool of a
// layer's compressed bytes, reaches no disk).
func writeBytes(b *testing.B, pid int) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	var written, cancelled int64 = -1, 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "write_bytes: "); ok {
			written, _ = strconv.ParseInt(v, 10, 64)
		}
		if v, ok := strings.CutPrefix(sc.Text(), "cancelled_write_bytes: "); ok {
			cancelled, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	if written < 0 {
		b.Fatal("no write_bytes in /proc/PID/io")
	}
	return written - cancelled
}

// du is the bytes the files under dir take on disk.
func du(b *testing.B, dir string) int64 {
	out, err := exec.Command("du", "-sB1", "-x", dir).Output()
	if err != nil {
		b.Fatal(err)
	}
	n, _ := strconv.ParseInt(strings.Fields(string(out))[0], 10, 64)
	return n
}
