//go:build !front

package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/units"
)

func (a *app) vmCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:         "vm",
		Short:       "Bootable disk images for full VMs",
		Annotations: map[string]string{localAnnotation: "true"},
		Long: `A full VM boots a whole operating system from its own disk through UEFI firmware: its own
boot loader, kernel, initramfs and init (systemd), where a microVM boots dsec's kernel and agent.
dsec vm image builds such a disk from a tree and keeps it in the store at <root>/store, named as
layers are (NAME[:VERSION]), for the VMs that boot copy-on-write overlays of it.

dsec run --backend vm --base NAME boots one: QEMU's q35 machine through Debian's OVMF firmware,
its disk a copy-on-write overlay of the image's (every VM of an image shares it), and dsec's
agent as a service of the guest's systemd. Commands, their journal, files, stop and start are
as in a microVM; dsec screen and dsec input show its screen and drive its keyboard and mouse.
docs/vm.md says what is not in this release yet (snapshots, VNC).`,
	}
	image := &cobra.Command{Use: "image", Short: "Build and manage bootable disk images"}
	image.AddCommand(a.vmImageBuild(), a.vmImageImport(), a.vmImageCopy(true), a.vmImageCopy(false), a.vmImageList(), a.vmImageInspect(), a.vmImageRemove())
	cmd.AddCommand(image)
	return cmd
}

func (a *app) vmImageBuild() *cobra.Command {
	var (
		tag, size, espSize, seed string
		args                     []string
		force, asJSON            bool
	)
	cmd := &cobra.Command{
		Use:   "build TREE... -t NAME[:VERSION]",
		Short: "Make a bootable disk image from a root file system tree or layers",
		Long: `Build makes a GPT disk image from TREE, a root file system that boots by itself: its newest
kernel with its initramfs (boot/vmlinuz-VERSION, boot/initrd.img-VERSION), systemd-boot
(` + vm.LoaderPath + `) and an init (sbin/init), as Debian's linux-image-amd64,
systemd-boot-efi and systemd-sysv install them.
The disk holds an EFI system partition (FAT32: systemd-boot as the firmware's default loader,
one entry booting that kernel) and a root partition (ext4 made from TREE with its owners,
modes, xattrs and special files; nothing is mounted). The kernel gets root=PARTUUID=...,
rw and console=tty0 console=ttyS0, then every --kernel-arg.

Several TREEs are one tree, topmost first, as overlayfs stacks them (read-only, mounted only
while the build reads them): a small tree of your files over a distribution's, without a copy.
A TREE that is no path on this host may name a layer of the store (NAME[:VERSION]; a snapshot
brings the layers it stands on) or an image imported with dsec image pull: its layers are
mounted read-only and stacked as a sandbox's root would be, whiteouts included.

Where the tree has systemd, the build installs dsec's guest agent as its service
(/etc/systemd/system/dsec-agent.service, with run-dsec-agent.mount): dsec run --backend vm
boots the image and runs commands through it. The agent's binary is not in the image: the
worker gives each VM its own, on a read-only disk, at every boot.

--size is the disk's (default: the tree plus 2 GiB free for the guest's own writes); the store
keeps it as qcow2, which takes what the partitions hold, a blob named by its digest and tagged
NAME[:VERSION]. --seed names its GUIDs (the same seed, the same GUIDs), not its bytes: two builds
of one tree differ in their file systems' times.

` + exitCodesHelp,
		Example: `  debootstrap --variant=minbase --include=linux-image-amd64,systemd-sysv,systemd-boot-efi,udev,initramfs-tools \\
      bookworm /srv/deb http://deb.debian.org/debian
  dsec vm image build /srv/deb -t debian-vm:12
  dsec vm image build /srv/deb -t debian-vm:12 --size 20GiB --kernel-arg quiet --force --json
  dsec vm image build ./my-files /srv/deb -t task-vm:1
  dsec vm image build task-files:1 debian-base:12 -t task-vm:2     # layers of the store
  dsec run --backend vm --base debian-vm:12 -- uname -a`,
		Args: minArgs(1),
		RunE: func(cmd *cobra.Command, pos []string) error {
			if tag == "" {
				return usageError{fmt.Errorf("vm image build needs -t NAME[:VERSION]")}
			}
			ref, err := layer.ParseRef(tag)
			if err != nil {
				return usageError{errors.New(strings.Replace(userMessage(err), "bad layer ", "bad VM image ", 1))}
			}
			o := vm.BuildOptions{Force: force, DiskOptions: vm.DiskOptions{KernelArgs: args, Seed: seed}}
			for _, x := range []struct {
				flag, v, eg string
				to          *int64
			}{{"--size", size, "20GiB", &o.Size}, {"--esp-size", espSize, "512MiB", &o.ESPSize}} {
				if x.v == "" {
					continue
				}
				if *x.to, err = units.ParseBytes(x.v); err != nil || *x.to <= 0 {
					return usageError{fmt.Errorf("bad %s %q: give a size in MiB, GiB or TiB, e.g. %s", x.flag, x.v, x.eg)}
				}
			}
			s, err := a.openStore()
			if err != nil {
				return err
			}
			start := time.Now()
			img, err := vm.Build(cmd.Context(), s, pos, ref, o)
			if err != nil {
				return err
			}
			a.log.Info("built VM image", "image", img.Tag, "kernel", img.Disk.Kernel, "seconds", time.Since(start).Seconds())
			if asJSON {
				return a.printJSON(img)
			}
			_, err = fmt.Fprintln(a.stdout, img.Tag)
			return err
		},
	}
	cmd.Flags().StringVarP(&tag, "tag", "t", "", "NAME[:VERSION] to tag the image with (required)")
	cmd.Flags().StringVar(&size, "size", "", "the whole disk's size (default: the tree plus 2 GiB); stored as what it holds")
	cmd.Flags().StringVar(&espSize, "esp-size", "", "the EFI system partition's size, at least 64MiB (default 256MiB)")
	cmd.Flags().StringArrayVar(&args, "kernel-arg", nil, "a kernel parameter to add (repeat for more)")
	cmd.Flags().StringVar(&seed, "seed", "", "names the disk's GUIDs: the same seed gives the same GUIDs (default: random)")
	cmd.Flags().BoolVar(&force, "force", false, "replace a VM image of that name")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the image as JSON")
	return cmd
}

func (a *app) vmImageImport() *cobra.Command {
	var (
		tag, format            string
		noAgent, force, asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "import FILE -t NAME[:VERSION]",
		Short: "Make a VM image of an existing raw or qcow2 disk",
		Long: `Import keeps FILE, a raw or qcow2 disk image that boots through UEFI from a GPT (an EFI system
partition with its loader), as a VM image in the store: its bytes as they are, stored as qcow2,
a blob named by its digest and tagged NAME[:VERSION]. Its format is qemu-img's probe unless
--format names it. A qcow2 file that reads another file (a backing file, an external data
file) or is encrypted is refused: flatten it first (qemu-img convert -O qcow2).

Where the disk has an ext4 root partition with systemd, dsec's guest agent's units are
installed there as dsec vm image build installs them (nothing is mounted), so that dsec run
--backend vm runs it; --no-agent leaves the disk's bytes alone. An image without the agent is
kept, and the vm backend refuses it (dsec vm image inspect says so).

` + exitCodesHelp,
		Example: `  dsec vm image import ./debian-12-genericcloud-amd64.qcow2 -t debian-cloud:12
  dsec vm image import ./disk.img --format raw -t task-vm:1 --json`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, pos []string) error {
			if tag == "" {
				return usageError{fmt.Errorf("vm image import needs -t NAME[:VERSION]")}
			}
			ref, err := layer.ParseRef(tag)
			if err != nil {
				return usageError{errors.New(strings.Replace(userMessage(err), "bad layer ", "bad VM image ", 1))}
			}
			s, err := a.openStore()
			if err != nil {
				return err
			}
			img, err := vm.Import(cmd.Context(), s, pos[0], ref, vm.ImportOptions{Format: format, NoAgent: noAgent, Force: force})
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(img)
			}
			_, err = fmt.Fprintln(a.stdout, img.Tag)
			return err
		},
	}
	cmd.Flags().StringVarP(&tag, "tag", "t", "", "NAME[:VERSION] to tag the image with (required)")
	cmd.Flags().StringVar(&format, "format", "", "the file's format, raw or qcow2 (default: qemu-img's probe)")
	cmd.Flags().BoolVar(&noAgent, "no-agent", false, "do not install dsec's guest agent's units")
	cmd.Flags().BoolVar(&force, "force", false, "replace a VM image of that name")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the image as JSON")
	return cmd
}

func (a *app) vmImageCopy(push bool) *cobra.Command {
	var f copyFlags
	verb, short, long, example := "pull", "Copy a VM image from a remote into the local store",
		`Pull copies VM image NAME[:VERSION] from REMOTE into the local store: its record and every
image of its disk's chain the store lacks (a snapshot's base is there already when the image
it was taken over is), each checked against its digest as it arrives, then the tag. Pulling
again resumes an interrupted pull and costs nothing when the image is there.`,
		`  dsec vm image pull debian-vm:12 oci://registry.internal:5000/dsec
  dsec vm image pull task:3 shared            # a remote named in the config file`
	if push {
		verb, short, long, example = "push", "Copy a VM image from the local store to a remote",
			`Push copies VM image NAME[:VERSION] from the local store to REMOTE: its record and every image
of its disk's chain the remote lacks, then the tag, which moves last. A snapshot of a VM goes
with the chain it stands on. A tag that names other content on the remote is replaced only
with --force.

REMOTE is dir:///PATH, oci://HOST[:PORT]/REPOSITORY or a name under remotes: in the config
file, as for dsec layer push; without it, the config's remote: is used.`,
			`  dsec vm image push debian-vm:12 dir:///mnt/shared/dsec
  dsec vm image push task:3 oci://127.0.0.1:5000/dsec --json`
	}
	cmd := &cobra.Command{
		Use:     verb + " NAME[:VERSION] [REMOTE]",
		Short:   short,
		Long:    long + "\n\n" + exitCodesHelp,
		Example: example,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 1 || len(args) > 2 {
				return usageError{fmt.Errorf("vm image %s takes NAME[:VERSION] and an optional REMOTE", verb)}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, err := layer.ParseRef(args[0])
			if err != nil {
				return usageError{errors.New(strings.Replace(userMessage(err), "bad layer ", "bad VM image ", 1))}
			}
			res, err := a.copyRef(cmd, args[1:], ref, f, push, vm.Copy)
			if err != nil || f.json {
				return err
			}
			copied, skipped, n := res.Totals()
			fmt.Fprintf(a.stderr, "%s %s: %d blobs copied (%s), %d already there\n", verb, res.Ref, copied, humanBytes(n), skipped)
			_, err = fmt.Fprintln(a.stdout, res.Manifest)
			return err
		},
	}
	fl := cmd.Flags()
	fl.BoolVar(&f.force, "force", false, "replace a tag that names other content")
	fl.BoolVar(&f.insecure, "insecure", false, "no longer needed: a registry on localhost is spoken to over plain HTTP without it")
	fl.BoolVar(&f.json, "json", false, "print what was copied as JSON")
	return cmd
}

func (a *app) vmImageList() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the VM images in the store",
		Example: `  dsec vm image ls
  dsec vm image ls --json | jq -r '.[].name'`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			all, err := vm.List(cmd.Context(), s)
			if err != nil {
				return err
			}
			if asJSON {
				if all == nil {
					all = []*vm.Image{}
				}
				return a.printJSON(all)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tOS\tKERNEL\tDISK\tCREATED")
			for _, i := range all {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", i.Tag, i.Disk.OS, i.Disk.Kernel, humanBytes(i.Disk.Size), i.Created.Local().Format(time.DateTime))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return cmd
}

func (a *app) vmImageInspect() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "inspect NAME[:VERSION]",
		Short: "Show a VM image's disk: its partitions, kernel and command line",
		Long: `Inspect shows a VM image the store holds: its disk's size and blob, the kernel its loader
boots and its command line, and the partitions (offsets, sizes and GUIDs).

` + exitCodesHelp,
		Example: `  dsec vm image inspect debian-vm:12
  dsec vm image inspect --json debian-vm:12 | jq .disk.cmdline`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			img, err := vm.Lookup(cmd.Context(), s, args[0])
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(img)
			}
			held := 0
			for _, f := range img.Files(s) {
				if _, err := os.Stat(f); err == nil {
					held++
				}
			}
			return printVMImage(a.stdout, img, held)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// printVMImage prints img, held disks of whose chain are in the store.
func printVMImage(w io.Writer, img *vm.Image, held int) error {
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	d := img.Disk
	fmt.Fprintf(tw, "name:\t%s\n", img.Tag)
	fmt.Fprintf(tw, "os:\t%s\n", d.OS)
	if len(img.Chain) > 1 {
		var all int64
		for _, c := range img.Chain {
			all += c.Size
		}
		fmt.Fprintf(tw, "disk:\t%s (qcow2 of %s: a diff of %s over %d images, %s in all)\n", img.Path, humanBytes(d.Size),
			humanBytes(img.Blob.Size), len(img.Chain)-1, humanBytes(all))
	} else {
		fmt.Fprintf(tw, "disk:\t%s (qcow2 of %s, taking %s)\n", img.Path, humanBytes(d.Size), humanBytes(img.Blob.Size))
	}
	if held < len(img.Chain) {
		fmt.Fprintf(tw, "held:\t%d of its %d disks; the rest are read lazily from the shared remote (dsec vm image pull fetches them)\n", held, len(img.Chain))
	}
	if img.Sandbox != "" {
		fmt.Fprintf(tw, "snapshot:\tof sandbox %s, over %s\n", img.Sandbox, img.Parent)
	}
	fmt.Fprintf(tw, "kernel:\t%s\n", d.Kernel)
	fmt.Fprintf(tw, "cmdline:\t%s\n", d.Cmdline)
	for _, p := range []struct {
		name string
		p    vm.Partition
	}{{"esp", d.ESP}, {"root", d.Root}} {
		fmt.Fprintf(tw, "%s:\toffset %d, %s, PARTUUID %s\n", p.name, p.p.Offset, humanBytes(p.p.Size), p.p.UUID)
	}
	agent := "none: its tree has no systemd, and dsec run --backend vm cannot run it"
	if d.Agent != "" {
		agent = "dsec's, started by " + d.Agent
	}
	fmt.Fprintf(tw, "agent:\t%s\n", agent)
	fmt.Fprintf(tw, "source:\t%s\n", img.Source)
	fmt.Fprintf(tw, "created:\t%s\n", img.Created.Local().Format(time.DateTime))
	return tw.Flush()
}

func (a *app) vmImageRemove() *cobra.Command {
	return &cobra.Command{
		Use:     "rm NAME[:VERSION]...",
		Aliases: []string{"remove"},
		Short:   "Remove VM images; dsec layer gc frees their disks",
		Example: `  dsec vm image rm debian-vm:12 && dsec layer gc`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{fmt.Errorf("vm image rm needs at least one NAME[:VERSION]")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			for _, ref := range args { // each said as it goes: a failure after names what went
				img, err := vm.Remove(cmd.Context(), s, ref)
				if err != nil {
					return err
				}
				fmt.Fprintln(a.stdout, img.Tag)
			}
			return nil
		},
	}
}
