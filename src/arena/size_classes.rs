//! Size classes for small blocks: four per power of two from 64 bytes
//! (64, 80, 96, 112, 128, 160, ...), so a block wastes at most 25 %. A
//! class's blocks are aligned to the largest power of two dividing its
//! size (capped at a page), which is how an alignment request is met.

/// Largest alignment the arena gives (a page).
pub const MAX_ALIGN: usize = 4096;

/// Size of class `c`.
pub fn class_size(c: usize) -> usize {
    let (shift, step) = (4 + c / 4, 4 + c % 4);
    step << shift
}

/// Alignment every block of class `c` has.
pub fn class_align(c: usize) -> usize {
    let s = class_size(c);
    (s & s.wrapping_neg()).min(MAX_ALIGN)
}

/// Number of classes whose size is at most `max_small`.
pub fn class_count(max_small: usize) -> usize {
    (0..).take_while(|c| class_size(*c) <= max_small).count()
}

/// The smallest class of at most `max_small` bytes that holds `size`
/// bytes aligned to `align` (a power of two, at most [`MAX_ALIGN`]).
pub fn class_for(size: usize, align: usize, max_small: usize) -> Option<usize> {
    (0..class_count(max_small)).find(|c| class_size(*c) >= size && class_align(*c) >= align)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_grow_by_quarters_and_meet_alignment() {
        let sizes: Vec<usize> = (0..9).map(class_size).collect();
        assert_eq!(sizes, [64, 80, 96, 112, 128, 160, 192, 224, 256]);
        assert_eq!(class_for(1, 1, 1 << 20).map(class_size), Some(64));
        assert_eq!(class_for(65, 8, 1 << 20).map(class_size), Some(80));
        assert_eq!(class_for(5000, 4096, 1 << 20).map(class_size), Some(8192));
        assert_eq!(class_for(4096, 4096, 1 << 20).map(class_size), Some(4096));
        assert_eq!(class_for((1 << 20) + 1, 8, 1 << 20), None);
        for c in 0..class_count(1 << 20) {
            assert_eq!(class_size(c) % class_align(c), 0);
            assert!(class_align(c) >= 16);
        }
        // No class wastes more than 25 % of a block.
        for size in (64..(1 << 20)).step_by(97) {
            let s = class_size(class_for(size, 1, 1 << 20).unwrap());
            assert!(s * 4 <= size * 5 + 64 * 4, "size {size} -> class {s}");
        }
    }
}
